"""Fault injection: SIGKILL each process of a real run at a random moment, then resume to the end.

One run directory goes through every fault in turn (each resume starts where the previous kill left it):
the trainer, the orchestrator, the inference server and the launcher itself are killed; each time the run
must end within 30 s, exit non-zero naming the dead process, and leave no process behind. A final
`--resume-step` from the checkpoint before the newest (what is after it is discarded) then finishes the run:
every step must appear exactly once per process in metrics.jsonl, and inference serve the checkpoint's
policy, not the base model's.
Inference runs tensor-parallel (two workers per server): a killed server's workers must go with it, and a resumed
run's server loads the checkpoint's step on both.
Set RL_FAULT_SEED to replay the moments of a failed run.
"""

import os
import random
import signal
import time

import pytest

from rl.protocol import RunPaths, read_metrics, stable_steps
from tests.integration.launched import Launched, rl_command, wait_gone

pytestmark = pytest.mark.integration
# Each fault's run goes on for a checkpoint and up to a second more, which can be several of the tiny
# model's warm steps: enough must remain for the last fault to find the run still going.
MAX_STEPS = 18
VICTIMS = ["trainer", "orchestrator", "inference", "launcher"]
STOP_WITHIN_S = 30


def assert_still_running(run: Launched, before: str) -> None:
    assert run.proc.poll() is None, f"rl ended before {before}:\n{run.output[-4000:]}"


def wait_for_checkpoint_after(run: Launched, paths: RunPaths, step: int, timeout_s: float = 600) -> int:
    """Wait until a complete checkpoint newer than `step` exists; return its step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert_still_running(run, f"a checkpoint after step {step}")
        newer = [s for s in paths.complete_checkpoints() if s > step]
        if newer:
            return newer[-1]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint after step {step} within {timeout_s}s:\n{run.output[-4000:]}")


def kill(run: Launched, victim: str) -> None:
    pid = run.proc.pid if victim == "launcher" else run.child_pid(victim)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(1500)  # five launches of an 18-step run
def test_each_process_killed_then_resumed_to_completion(tiny_model, tmp_path):
    seed = int(os.environ.get("RL_FAULT_SEED", random.randrange(1 << 30)))
    print(f"RL_FAULT_SEED={seed}")
    rng = random.Random(seed)
    out = tmp_path / "run"
    paths = RunPaths(out)
    extra = ["--ckpt.interval", "1", "--inference.tensor-parallel-size", "2"]
    resumed_from = -1
    for victim in VICTIMS:
        run = Launched(rl_command(tiny_model, out, MAX_STEPS, *extra, *(["--resume"] if resumed_from >= 0 else [])))
        resumed_from = wait_for_checkpoint_after(run, paths, max(resumed_from, 0))
        time.sleep(rng.uniform(0, 1))  # somewhere inside the next step or so
        assert_still_running(run, f"the fault on {victim}")
        processes = run.descendants()
        kill(run, victim)
        killed_at = time.monotonic()
        code = run.wait(timeout=STOP_WITHIN_S + 30)
        if victim == "launcher":
            assert code == -signal.SIGKILL
        else:
            assert time.monotonic() - killed_at < STOP_WITHIN_S, f"stopping took too long after {victim} died"
            assert code != 0, run.output[-3000:]
            assert f"rl: {victim} was killed by SIGKILL" in run.output, run.output[-3000:]
        left = wait_gone(processes, STOP_WITHIN_S - (time.monotonic() - killed_at))
        assert not left, f"after {victim} was killed, still running: {left}"
        resumed_from = max(paths.complete_checkpoints())

    older = paths.complete_checkpoints()[-2]  # one per fault at least, so 3 or later
    final = Launched(rl_command(tiny_model, out, MAX_STEPS, *extra, "--resume-step", str(older)))
    assert final.wait(timeout=900) == 0, final.output[-5000:]
    assert f"resuming from step {older}" in final.output
    metrics = read_metrics(paths)
    for process in ("trainer", "orchestrator"):
        steps = [m["step"] for m in metrics if m["process"] == process]
        assert steps == list(range(MAX_STEPS)), f"{process} logged steps {steps}"
    orchestrator = {m["step"]: m for m in metrics if m["process"] == "orchestrator"}
    assert orchestrator[older]["policy_step"] >= older - 1  # async_level 1: the checkpoint's policy, or one before
    assert stable_steps(paths.weights_root)[-1] == MAX_STEPS
