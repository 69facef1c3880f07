"""`rl --slurm` for real: the job it renders runs to completion on a one-host SLURM cluster (slurmctld and
slurmd of Debian's slurm-wlm, started by the test), and the run trains and logs every step."""

import subprocess
import sys

import pytest

from rl.protocol import RunPaths, read_metrics
from tests.conftest import ROOT
from tests.integration.launched import SMALL_KV_CACHE, free_port
from tests.integration.slurm_cluster import SlurmCluster, slurm_available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not slurm_available(), reason="needs root and slurm-wlm + munge (apt-get install slurm-wlm munge)"
    ),
]


@pytest.fixture
def cluster(tmp_path):
    cluster = SlurmCluster(tmp_path / "slurm")
    yield cluster
    cluster.stop()


def test_the_rendered_job_runs_to_completion(tiny_model, tmp_path, cluster):
    out = tmp_path / "run"
    configs = ROOT / "configs" / "reverse_text"
    argv = [
        sys.executable, "-m", "rl.launcher.main",
        "--trainer", "@", str(configs / "train.toml"), "--orchestrator", "@", str(configs / "orch.toml"),
        "--inference", "@", str(configs / "infer.toml"), "--model.name", str(tiny_model), "--output-dir", str(out),
        "--max-steps", "3", "--seq-len", "128", "--orchestrator.batch-size", "32",
        "--inference.port", str(free_port()), "--slurm", "--slurm.trainer-nodes", "0", "--slurm.time", "00:20:00",
        *SMALL_KV_CACHE,
    ]
    submitted = subprocess.run(argv, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = submitted.stdout.split("submitted SLURM job ")[1].split()[0]
    state, exit_code = cluster.wait_job(job, timeout_s=900)
    log = (out / "slurm" / f"{job}.log")
    assert (state, exit_code) == ("COMPLETED", "0:0"), log.read_text()[-5000:] if log.exists() else state
    metrics = read_metrics(RunPaths(out))
    for process in ("trainer", "orchestrator"):
        assert [m["step"] for m in metrics if m["process"] == process] == [0, 1, 2], process
    assert "rl: finished" in log.read_text()
    assert "admin_token" not in (out / "slurm" / "rl.toml").read_text()
