import subprocess
import time

import pytest

from tests.conftest import ROOT, have

pytestmark = pytest.mark.skipif(not have("tmux"), reason="tmux is not installed")


def capture(pane: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", pane], capture_output=True, text=True).stdout


def test_tmux_panes_show_launcher_and_each_log(tiny_model, tmp_path):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    for name in ("trainer", "orchestrator", "inference"):
        (out / "logs" / f"{name}.log").write_text(f"line from the {name} log\n")
    session = f"rltest{int(time.time() * 1000) % 10**8}"
    subprocess.run(["bash", str(ROOT / "scripts/tmux.sh"), "-s", session, "-d", str(out),
                    "--model.name", str(tiny_model), "--dry-run"], check=True)
    try:
        panes = subprocess.run(
            ["tmux", "list-panes", "-t", session, "-F", "#{pane_id} #{pane_title}"], capture_output=True, text=True
        ).stdout.split("\n")
        by_title = dict(reversed(line.split(" ", 1)) for line in panes if line)
        assert set(by_title) == {"launcher", "trainer", "orchestrator", "inference"}
        deadline = time.monotonic() + 60
        while "commands" not in capture(by_title["launcher"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "rl.trainer.main" in capture(by_title["launcher"]).replace("\n", "")
        for name in ("trainer", "orchestrator", "inference"):
            assert f"line from the {name} log" in capture(by_title[name])
        # a line appended later shows up too: the panes follow the logs
        with open(out / "logs" / "trainer.log", "a") as f:
            f.write("a later trainer line\n")
        time.sleep(2)
        assert "a later trainer line" in capture(by_title["trainer"])
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
