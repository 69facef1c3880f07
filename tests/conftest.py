import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 model, built once per test session by the real CLI."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(out)], check=True, capture_output=True)
    return out


def have(program: str) -> bool:
    return shutil.which(program) is not None
