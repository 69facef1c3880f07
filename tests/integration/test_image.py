"""The CPU image, built and run: scripts/image-check.sh builds it with the builder this machine has and runs
`rl --dry-run` and 3 steps of the quickstart's configs in it. Skips only where no builder exists (CI's machines
have none: a build there would cost ~8 minutes of the suite's 35)."""

import re
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_the_cpu_image_builds_and_runs_three_steps_of_the_quickstart():
    script = ["bash", str(ROOT / "scripts" / "image-check.sh")]
    if subprocess.run([*script, "--builder"], capture_output=True).returncode == 3:
        pytest.skip("no image builder here (docker with a daemon, podman or buildah)")
    done = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(r"image-check: the image runs as uid [1-9]\d*\n", output), output[-4000:]
    assert "image-check: rl --dry-run in the image: ok" in output
    assert re.search(r"image-check: \S+ built in \d+ s, [\d.]+ ?[GM]B; the 3-step run took \d+ s", output), output
    assert re.search(r"image-check: rl: finished: 3 steps", output), output[-4000:]
