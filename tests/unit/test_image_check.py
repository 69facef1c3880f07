"""scripts/image-check.sh picks the builder the machine has: docker where its daemon answers, else podman, else
buildah; none is a clear exit 3 (the image test then skips)."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "image-check.sh"


def which_builder(bin_dir: Path, **fakes: str) -> subprocess.CompletedProcess:
    """`image-check.sh --builder` on a PATH of bash, dirname and the given fake commands ({name: shell body})."""
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "dirname", "head"):
        (bin_dir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!{bin_dir}/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return subprocess.run([str(bin_dir / "bash"), str(SCRIPT), "--builder"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": str(bin_dir)})


@pytest.mark.parametrize("fakes, expected", [
    ({}, None),
    ({"docker": "exit 1"}, None),  # a client without a daemon builds nothing
    ({"docker": "exit 1", "buildah": "exit 0"}, "buildah"),
    ({"docker": "exit 1", "podman": "exit 0", "buildah": "exit 0"}, "podman"),
    ({"docker": "exit 0", "podman": "exit 0"}, "docker"),
])
def test_the_builder_is_the_first_that_can_build(tmp_path, fakes, expected):
    done = which_builder(tmp_path / "bin", **fakes)
    if expected is None:
        assert done.returncode == 3 and "no image builder (docker with a daemon, podman or buildah)" in done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stderr


def test_the_build_context_leaves_out_secrets_and_run_directories():
    """What `.dockerignore` leaves out of the image, matched as Docker matches (`**` any directories, else one
    segment each): rl's recommended secrets file, env files, keys, and a run's records wherever the run was made."""
    import fnmatch

    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]

    def matches(path: str, pattern: str) -> bool:
        if pattern.startswith("**/"):
            parts = path.split("/")
            return any(fnmatch.fnmatch("/".join(parts[i:]), pattern[3:]) for i in range(len(parts)))
        return fnmatch.fnmatch(path, pattern)

    def ignored(path: str) -> bool:  # a directory left out leaves out all beneath it
        parts = path.split("/")
        return any(matches("/".join(parts[:i]), p) for i in range(1, len(parts) + 1) for p in patterns)

    for path in ("secrets.toml", "configs/secrets-prod.toml", ".env", "deploy/.env.local", "team.env", "tls/server.key",
                 "my-run/metrics.jsonl", "my-run/checkpoints/step_4/trainer/STABLE", "my-run/rollouts/step_3/r0.st"):
        assert ignored(path), path
    for path in ("src/rl/config.py", "configs/reverse_text/train.toml", "src/rl/weights/digest.py", "README.md"):
        assert not ignored(path), path


def test_the_image_runs_as_a_user_that_is_not_root_with_a_folder_to_write_runs_in():
    """The last USER of the Dockerfile names a user it creates (not root, not uid 0), set before the entrypoint,
    and /app/outputs belongs to it."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines() if line.strip()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0", "0:0"), users
    user = users[-1]
    created = " ".join(line for line in lines if line.startswith("RUN ") and "useradd" in line)
    assert f" {user} " in f"{created} " and "--uid 0 " not in created
    assert f"-o {user}" in created and "/app/outputs" in created
    assert lines.index(next(line for line in lines if line == f"USER {user}")) < lines.index(
        next(line for line in lines if line.startswith("ENTRYPOINT")))
