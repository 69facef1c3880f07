"""The README's quickstart as it is: build the tiny model, SFT warm-up, then RL with `rl`; the reward of
the last steps must exceed that of the first steps by more than noise (three standard errors)."""

import json
import subprocess
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1800)  # the README's whole quickstart: ~3 min measured
def test_quickstart_reward_rises(tmp_path):
    out = tmp_path / "quickstart"
    start = time.monotonic()
    done = subprocess.run(["bash", "scripts/quickstart.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    run = out / "run"
    assert (run / "reward.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((run / "summary.json").read_text())
    print(f"quickstart in {elapsed:.0f}s: {summary}")
    assert summary["steps"] == 60
    assert summary["reward_gain"] > summary["noise_3se"], summary
    assert "gain" in done.stdout  # the launcher's closing summary line
