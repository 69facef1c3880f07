"""Every run reproducible (issue 90): two step-synchronous runs with one sampling seed sample the same tokens and
train bitwise the same weights (each step's checksum as its server proved it), and `rl replay` trains an
asynchronous run again from its recorded batches into the same checksums, from step 0 and from a checkpoint."""

import subprocess
import sys

import pytest
from safetensors.torch import load_file

from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration
STEPS = 4


def served(out) -> dict[int, list[str]]:
    return {r["step"]: r["served_checksums"] for r in read_metrics(RunPaths(out))
            if r["process"] == "orchestrator" and r.get("served_checksums")}


def batch_ids(out, step: int) -> list[list[int]]:
    paths = RunPaths(out)
    return [load_file(str(f))["input_ids"].tolist() for f in sorted(paths.rollouts(step).glob("rank_*.safetensors"))]


def run(model, out, *extra) -> None:
    launched = Launched(rl_command(model, out, STEPS, "--trainer.keep-rollouts", "100", *extra))
    assert launched.wait(timeout=300) == 0, "".join(launched.lines[-60:])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from rl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_two_synchronous_runs_with_one_seed_are_bitwise_the_same(model, tmp_path):
    sync = ("--async-level", "0", "--orchestrator.sampling.seed", "7")
    run(model, tmp_path / "a", *sync)
    run(model, tmp_path / "b", *sync)
    for step in range(STEPS):
        assert batch_ids(tmp_path / "a", step) == batch_ids(tmp_path / "b", step), f"step {step}'s tokens differ"
    a, b = served(tmp_path / "a"), served(tmp_path / "b")
    assert len(a) == STEPS - 1 and a == b  # steps 1..3, each its own policy's weights
    assert len({tuple(v) for v in a.values()}) == STEPS - 1


def test_replay_of_an_asynchronous_run_reproduces_every_served_checksum(model, tmp_path):
    run(model, tmp_path / "run", "--async-level", "1", "--ckpt.interval", "2")
    replay = [sys.executable, "-m", "rl.launcher.main", "replay", str(tmp_path / "run")]
    done = subprocess.run([*replay, "--output-dir", str(tmp_path / "again")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compared with the run's checksums: every one bitwise the same" in done.stdout
    assert "DIFFERS" not in done.stdout and done.stdout.count(": same (") >= 2
    done = subprocess.run([*replay, "--output-dir", str(tmp_path / "later"), "--from-step", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "every one bitwise the same" in done.stdout, done.stdout + done.stderr
