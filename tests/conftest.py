import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_ENVIRONMENTS = ROOT / "tests" / "fixtures" / "environments"


@pytest.fixture(autouse=True, scope="session")
def environment_process_patches():
    """What the orchestrator's and eval's main() apply first (rl/patches/): tests run their parts in this process."""
    from rl.orchestrator.rollouts import apply_patches

    apply_patches()


REQUIRE_GPU = "RL_REQUIRE_GPU"  # set by scripts/gpu-check.sh: there a GPU test that skips has shown nothing


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


INTEGRATION = "tests/integration/"


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under xdist's default load balancing (`-n 2` in pyproject.toml), the tests under tests/integration/ are one
    unit of work: they run one at a time, in order, in one worker (each starts processes that use the host's cores,
    and some time a process's exit), while the unit tests run in the other."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return INTEGRATION if nodeid.startswith(INTEGRATION) else nodeid

    return IntegrationInOneWorker(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under gpu-check (RL_REQUIRE_GPU=1), a GPU test that skips (no CUDA, too few GPUs, ...) fails, saying why."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and os.environ.get(REQUIRE_GPU) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped under {REQUIRE_GPU}=1 (gpu-check), a failure there: {reason}"


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
