"""`rl replay`'s refusals, each naming what is missing, before anything starts (the replay itself:
tests/integration/test_reproducible.py)."""

import pytest

from rl.launcher.main import main as rl_main
from rl.protocol import RunPaths, append_metrics, mark_stable


def a_run(root, steps: int = 3, kept: range = range(3)) -> RunPaths:
    paths = RunPaths(root)
    paths.configs.mkdir(parents=True)
    (paths.configs / "trainer.toml").write_text(f'max_steps = {steps}\noutput_dir = "{root}"\n')
    for step in kept:
        paths.rollouts(step).mkdir(parents=True)
        (paths.rollouts(step) / "rank_0.safetensors").write_bytes(b"x")
        mark_stable(paths.rollouts(step))
    for step in range(steps):
        append_metrics(paths, {"process": "trainer", "step": step, "time": 1.0})
    return paths


@pytest.mark.parametrize("kept, args, error", [
    (range(1, 3), [], "lacks the batches of steps [0] (pruned once trained: run with --trainer.keep-rollouts"),
    (range(3), ["--from-step", "2"], "has no complete trainer checkpoint of step 2"),
])
def test_a_run_that_cannot_be_replayed_is_refused_naming_what_is_missing(tmp_path, capsys, kept, args, error):
    run = a_run(tmp_path / "run", kept=kept)
    with pytest.raises(SystemExit) as exit:
        rl_main(["replay", str(run.root), "--output-dir", str(tmp_path / "again"), *args])
    assert exit.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_a_directory_that_is_no_run_or_a_replay_into_a_used_one_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        rl_main(["replay", str(tmp_path), "--output-dir", str(tmp_path / "again")])
    assert "is not an rl run directory" in capsys.readouterr().err
    run = a_run(tmp_path / "run")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("mine")
    with pytest.raises(SystemExit):
        rl_main(["replay", str(run.root), "--output-dir", str(tmp_path / "used")])
    assert "is not empty: replay into a new directory" in capsys.readouterr().err
