import json

import pytest

from rl.config import ConfigError
from rl.launcher.report import summarize
from rl.launcher.resume import choose_checkpoint, discard_after
from rl.protocol import STABLE, RunPaths, append_metrics, mark_stable, read_metrics


def make_checkpoint(paths: RunPaths, step: int, parts=("trainer", "orchestrator")) -> None:
    for part in parts:
        (paths.checkpoint(step) / part).mkdir(parents=True)
        (paths.checkpoint(step) / part / "state.bin").write_bytes(bytes(range(64)))
        mark_stable(paths.checkpoint(step) / part, step=step)


def make_step_dirs(root, steps, stable=True):
    for s in steps:
        (root / f"step_{s}").mkdir(parents=True)
        if stable:
            (root / f"step_{s}" / STABLE).touch()


def test_only_checkpoints_with_both_parts_count(tmp_path):
    paths = RunPaths(tmp_path)
    make_checkpoint(paths, 2)
    make_checkpoint(paths, 4)
    make_checkpoint(paths, 6, parts=("trainer",))  # orchestrator part never finished
    assert paths.complete_checkpoints() == [2, 4]
    assert choose_checkpoint(paths, None) == 4
    assert choose_checkpoint(paths, 2) == 2
    with pytest.raises(ConfigError, match=r"\[2, 4\]"):
        choose_checkpoint(paths, 6)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        choose_checkpoint(RunPaths(tmp_path / "empty"), None)


def test_pruning_keeps_complete_checkpoints_when_the_orchestrator_is_ahead(tmp_path):
    """The orchestrator writes its part of step k before the trainer does: pruning each part by its own
    newest steps (orchestrator 3, 4; trainer 1, 2) would leave no step to resume from."""
    paths = RunPaths(tmp_path)
    make_checkpoint(paths, 1)
    make_checkpoint(paths, 2)
    make_checkpoint(paths, 3, parts=("orchestrator",))
    make_checkpoint(paths, 4, parts=("orchestrator",))
    assert paths.prunable_checkpoint_steps("orchestrator", keep=2) == []
    assert paths.prunable_checkpoint_steps("trainer", keep=2) == []
    make_checkpoint(paths, 3, parts=("trainer",))
    assert paths.prunable_checkpoint_steps("orchestrator", keep=2) == [1]
    assert paths.prunable_checkpoint_steps("trainer", keep=2) == [1]


def test_pruning_both_parts_removes_the_step_directory_whoever_prunes_last(tmp_path):
    for last in ("trainer", "orchestrator"):
        paths = RunPaths(tmp_path / last)
        for step in (1, 2, 3):
            make_checkpoint(paths, step)
        first = "orchestrator" if last == "trainer" else "trainer"
        paths.prune_checkpoint_parts(first, keep=2)
        assert (paths.checkpoint(1) / last).is_dir() and not (paths.checkpoint(1) / first).exists()
        paths.prune_checkpoint_parts(last, keep=2)
        assert not paths.checkpoint(1).exists()
        assert paths.complete_checkpoints() == [2, 3]


def test_a_damaged_checkpoint_is_never_resumed_from(tmp_path, capsys):
    paths = RunPaths(tmp_path)
    make_checkpoint(paths, 2)
    make_checkpoint(paths, 4)
    (paths.checkpoint(4) / "trainer" / "state.bin").write_bytes(bytes(range(10)))  # truncated by a crash
    assert choose_checkpoint(paths, None) == 2
    assert "checkpoints/step_4/trainer/state.bin has 10 bytes" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="state.bin has 10 bytes, 64 were written"):
        choose_checkpoint(paths, 4)
    (paths.checkpoint(2) / "orchestrator" / "state.bin").write_bytes(bytes(range(1, 65)))
    with pytest.raises(ConfigError, match="every checkpoint is damaged.*CRC-32"):
        choose_checkpoint(paths, None)


def test_discard_after_removes_later_steps_and_metrics(tmp_path):
    paths = RunPaths(tmp_path)
    make_step_dirs(paths.rollouts_root, [0, 1, 2, 3])
    make_step_dirs(paths.rollouts_root, [4], stable=False)
    make_step_dirs(paths.weights_root, [1, 2, 3, 4])
    (paths.weights_root / ".step_5.tmp99").mkdir()
    for step in range(4):
        for process in ("trainer", "orchestrator"):
            append_metrics(paths, {"process": process, "step": step})
    with open(paths.metrics, "a") as f:
        f.write('{"process": "trainer", "st')  # torn line from a crash
    discard_after(paths, 2)
    assert sorted(p.name for p in paths.rollouts_root.iterdir()) == ["step_0", "step_1"]
    assert sorted(p.name for p in paths.weights_root.iterdir()) == ["step_1", "step_2"]
    assert sorted((m["process"], m["step"]) for m in read_metrics(paths)) == [
        ("orchestrator", 0), ("orchestrator", 1), ("trainer", 0), ("trainer", 1)
    ]


def test_summary_and_plot(tmp_path):
    paths = RunPaths(tmp_path)
    for step, reward in enumerate([0.1, 0.2, 0.3, 0.5, 0.6, 0.7]):
        append_metrics(paths, {"process": "orchestrator", "step": step, "reward": reward})
        append_metrics(paths, {"process": "trainer", "step": step, "loss": 1.0 - reward})
    summary = summarize(paths, elapsed_s=12.0)
    assert summary["steps"] == 6
    assert summary["start_reward"] == pytest.approx(0.2)
    assert summary["final_reward"] == pytest.approx(0.6)
    # step rewards 0.1 0.2 0.3 | 0.5 0.6 0.7: variances 0.01 each, 3 * sqrt(0.01/3 + 0.01/3) = 0.2449
    assert summary["reward_gain"] == pytest.approx(0.4)
    assert summary["noise_3se"] == pytest.approx(0.2449, abs=1e-4)
    assert (tmp_path / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["final_reward"] == pytest.approx(0.6)
