"""Faults with weights over the wire (`--transfer.backend gloo`): the server SIGKILLed while a step arrives, then the
trainer SIGKILLed while it sends one (each held there by the `during_receive` test hook, so the kill lands mid-
transfer for certain); each time the run ends within 60 s naming the dead process and leaves nothing behind, and
`--resume` continues from the last checkpoint: the new servers load its files, then take every later step over the
wire, to the end."""

import re
import time

import pytest

from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, rl_command, wait_gone
from tests.integration.test_faults import kill, wait_for_checkpoint_after

pytestmark = pytest.mark.integration
# Each fault waits for a checkpoint newer than the last resume, then holds the next transfer: the first can land a
# few fast steps late (resumed from step 4, seen in CI), and the second still needs a checkpoint and a transfer after.
MAX_STEPS = 10
STOP_WITHIN_S = 60


def hold_mid_transfer(run: Launched, hooks, timeout_s: float = 300) -> None:
    """Arm the hook and wait until a server holds inside a transfer (the trainer blocked mid-send)."""
    (hooks / "during_receive").touch()
    deadline = time.monotonic() + timeout_s
    while not (hooks / "during_receive.held").exists():
        assert run.proc.poll() is None, f"rl ended before a transfer was held:\n{run.output[-4000:]}"
        assert time.monotonic() < deadline, f"no transfer held within {timeout_s} s:\n{run.output[-4000:]}"
        time.sleep(0.05)


@pytest.mark.timeout(1200)  # three launches
def test_a_server_then_the_trainer_killed_mid_transfer_then_resumed(tiny_model, tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    monkeypatch.setenv("RL_TEST_HOOK_DIR", str(hooks))
    out = tmp_path / "run"
    paths = RunPaths(out)
    extra = ["--transfer.backend", "gloo", "--ckpt.interval", "2"]
    resumed_from = 0
    for victim in ("inference", "trainer"):
        run = Launched(rl_command(tiny_model, out, MAX_STEPS, *extra, *(["--resume"] if resumed_from else [])))
        resumed_from = wait_for_checkpoint_after(run, paths, resumed_from)
        hold_mid_transfer(run, hooks)
        processes = run.descendants()
        kill(run, victim)
        killed_at = time.monotonic()
        code = run.wait(timeout=STOP_WITHIN_S + 30)
        assert time.monotonic() - killed_at < STOP_WITHIN_S, f"stopping took too long after {victim} died"
        assert code != 0 and f"rl: {victim} was killed by SIGKILL" in run.output, run.output[-3000:]
        left = wait_gone(processes, STOP_WITHIN_S - (time.monotonic() - killed_at))
        assert not left, f"after {victim} was killed mid-transfer, still running: {left}"
        for hook in hooks.iterdir():
            hook.unlink()
        resumed_from = max(paths.complete_checkpoints())

    final = Launched(rl_command(tiny_model, out, MAX_STEPS, *extra, "--resume"))
    assert final.wait(timeout=900) == 0, final.output[-5000:]
    assert f"resuming from step {resumed_from}" in final.output
    metrics = read_metrics(paths)
    for process in ("trainer", "orchestrator"):
        steps = [m["step"] for m in metrics if m["process"] == process]
        assert steps == list(range(MAX_STEPS)), f"{process} logged steps {steps}"
    trainer = {m["step"]: m for m in metrics if m["process"] == "trainer"}
    log = (out / "logs" / "orchestrator.log").read_text()
    # the resumed run's server served the checkpoint's files, then every later step over the wire, as sent
    after = log[log.rindex(f"resuming at step {resumed_from}"):]
    assert f"inference now serves policy {resumed_from}" in after
    taken = re.findall(r"policy (\d+) went over the wire to 1 of 1 servers \(checksums \['([0-9a-f]+)'\]\)", after)
    assert [int(step) for step, _ in taken] == list(range(resumed_from + 1, MAX_STEPS + 1)), taken
    for step, checksum in taken:
        assert checksum == trainer[int(step) - 1]["weights_checksum"], step
