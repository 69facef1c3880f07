"""A server the run does not own (started on its own, as on another host) restarts mid-run, weights over the wire,
killed while a step arrives (held there by the `during_receive` test hook, so the kill lands mid-transfer for
certain): the step fails by its deadlines and the run goes on; the orchestrator sees another instance answer, gives
it no requests until the trainer's next offer brings it up to date, makes again the groups it lost, and the run
reaches its end with every step once. Steps go as their changes (`transfer.sparse`) while the server serves the step
sent last, and whole to the restarted server; served in bf16 at an RL learning rate (1e-6), a step changes few
elements, as on GPUs."""

import re
import time

import pytest

from rl.protocol import RunPaths, read_metrics
from rl.inference.hooks import HOOK_DIR_ENV
from tests.integration.inference_server import Server
from tests.integration.test_faults_wire import hold_mid_transfer
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration
MAX_STEPS = 8
SECRET = "the secret of this test's run"  # the server runs apart from rl, so both are given it
WIRE = f'dtype = "bfloat16"\n[transfer]\nbackend = "gloo"\nsparse = true\nsecret = "{SECRET}"\n'


def wait_for_step(run: Launched, paths: RunPaths, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(m["process"] == "orchestrator" and m["step"] >= step for m in read_metrics(paths)):
        assert run.proc.poll() is None, f"rl ended before batch {step}:\n{run.output[-4000:]}"
        assert time.monotonic() < deadline, f"no batch {step} within {timeout_s} s:\n{run.output[-4000:]}"
        time.sleep(0.2)


def test_a_server_restarted_mid_run_rejoins_at_the_next_offer(tiny_model, tmp_path):
    out, hooks = tmp_path / "run", tmp_path / "hooks"
    paths = RunPaths(out)
    hooks.mkdir()
    server = Server(tiny_model, out / "weights", tmp_path / "inference-1.log", toml=WIRE,
                    env={HOOK_DIR_ENV: str(hooks)})
    roles = ["--roles", '["orchestrator", "trainer"]', "--orchestrator.client.base-urls", f'["{server.url}"]',
             "--inference.admin-token", server.token, "--transfer.backend", "gloo", "--transfer.sparse", "true",
             "--transfer.host", "127.0.0.1", "--transfer.secret", SECRET, "--inference.dtype", "bfloat16",
             "--trainer.optim.lr", "1e-6"]
    run = Launched(rl_command(tiny_model, out, MAX_STEPS, *roles))
    try:
        wait_for_step(run, paths, 2)
        hold_mid_transfer(run, hooks)
        server.proc.kill()  # SIGKILL mid-transfer: the orchestrator's request is cut off, as by a host that crashed
        server.stop()
        # a new process on the same port: it serves the base model again
        server = Server(tiny_model, out / "weights", tmp_path / "inference-2.log", toml=WIRE, port=server.port)
        assert run.wait(timeout=900) == 0, run.output[-5000:]
    finally:
        server.stop()
        run.proc.kill()
    metrics = read_metrics(paths)
    for process in ("trainer", "orchestrator"):
        assert [m["step"] for m in metrics if m["process"] == process] == list(range(MAX_STEPS)), process
    (log_file,) = (out / "logs").glob("*/orchestrator.log")  # roles split: each host's logs in a folder of its own
    log = log_file.read_text()
    back = re.search(r"server 0 (restarted|answers again): it serves policy (\d+)", log)
    assert back and back.group(2) == "0", log[-3000:]  # the new process serves its start-up weights
    after = log[back.end():]
    taken = re.search(r"policy (\d+) went over the wire to 1 of 1 servers", after)
    assert taken, after[-3000:]  # brought up to date by the next offer, before any batch used it
    trainer = {m["step"]: m for m in metrics if m["process"] == "trainer"}  # trainer step k sends policy k + 1
    assert trainer[0]["transfer_sparse"] is False  # the server served the base model, read from files
    assert trainer[int(taken.group(1)) - 1]["transfer_sparse"] is False  # the restarted server: whole again
    assert trainer[MAX_STEPS - 1]["transfer_sparse"] is True, trainer  # and changes once it serves a sent step
    whole = trainer[0]["transfer_bytes"]
    assert all(m["transfer_bytes"] < whole / 10 for m in trainer.values() if m["transfer_sparse"]), trainer
    # the trainer kept its group with the server until the restart, then formed one with the new process; each
    # process of the server formed its group once
    (trainer_log,) = (out / "logs").glob("*/trainer.log")
    assert trainer_log.read_text().count("formed the transfer group") == 2
    for log_name in ("inference-1.log", "inference-2.log"):
        assert (tmp_path / log_name).read_text().count("formed the transfer group") == 1, log_name
    orchestrator = [m for m in metrics if m["process"] == "orchestrator"]
    assert all(m["staleness"] <= 8 for m in orchestrator)  # continuous dispatch: max_off_policy_steps
