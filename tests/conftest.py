import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_ENVIRONMENTS = ROOT / "tests" / "fixtures" / "environments"


@pytest.fixture
def model(tmp_path) -> Path:
    """Enough of a model directory for the launcher's and the trainer's config checks (nothing is loaded before the
    start)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return path


@pytest.fixture(autouse=True, scope="session")
def environment_process_patches():
    """What the orchestrator's and eval's main() apply first (rl/patches/): tests run their parts in this process."""
    from rl.envs.process_setup import apply_patches

    apply_patches()


REQUIRE_GPU = "RL_REQUIRE_GPU"  # set by scripts/gpu-check.sh: there a GPU test that skips has shown nothing


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


SLOW_FIRST = {  # seconds per file in the fresh-clone CI at cb32d75 (one test at a time), rounded: the order of work
    "tests/integration/test_faults.py": 400, "tests/integration/test_quickstart.py": 320,
    "tests/integration/test_run_lora.py": 240, "tests/integration/test_tools.py": 225,
    "tests/integration/test_faults_wire.py": 220, "tests/integration/test_env_server.py": 200,
    "tests/integration/test_two_hosts.py": 180, "tests/integration/test_inference.py": 180,
    "tests/integration/test_orchestrator.py": 170, "tests/integration/test_bad_requests.py": 130,
    "tests/integration/test_inference_tp.py": 120, "tests/integration/test_trainer.py": 120,
    "tests/integration/test_server_restart.py": 100, "tests/integration/test_run.py": 95,
    "tests/integration/test_eval_plain_vllm.py": 95, "tests/integration/test_run_wire.py": 85,
    "tests/integration/test_inference_lora.py": 80, "tests/integration/test_environments.py": 75,
    "tests/integration/test_slurm.py": 70, "tests/integration/test_server_wire_trust.py": 60,
}
"""What is not listed comes after, in the order collected; a stale figure only packs the two workers less well."""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under xdist's load balancing (`-n 2` in pyproject.toml) each test file is one unit of work (a file's module
    fixtures, such as its inference server, are started once), and a worker that is about to run out takes the
    slowest file left: the integration tests go first, two at a time, and the unit tests fill the ends."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlowestFileFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            slowest = max(self.workqueue, key=lambda scope: SLOW_FIRST.get(scope, 0))
            self.workqueue.move_to_end(slowest, last=False)
            super()._assign_work_unit(node)

    return SlowestFileFirst(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under gpu-check (RL_REQUIRE_GPU=1), a GPU test that skips (no CUDA, too few GPUs, ...) fails, saying why."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and os.environ.get(REQUIRE_GPU) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped under {REQUIRE_GPU}=1 (gpu-check), a failure there: {reason}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo world on the CPU, as torchrun would give a single-process trainer (one per test module)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rl.trainer.world import World

    assert not dist.is_initialized(), "another test left a process group behind"
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    yield World(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo", mesh=mesh)
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 model, built once per test session by the real CLI."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture
def taskset_only_installed(monkeypatch):
    """The fixture environments (tests/fixtures/environments) importable by the processes a test starts, as an
    installed package would be."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURE_ENVIRONMENTS))


def have(program: str) -> bool:
    return shutil.which(program) is not None


@pytest.fixture(autouse=True)
def nothing_a_test_started_outlives_it():
    """Servers and `rl` runs a test started and left running (it failed, or pytest-timeout stopped it) are stopped
    after it. Those of module-scoped fixtures were started before this fixture and are left to their fixture."""
    from tests.integration.launched import STARTED

    before = set(STARTED)
    yield
    for started in set(STARTED) - before:
        started.stop()
