from rl.protocol import RunPaths, mark_stable
from rl.trainer.config import TrainerConfig
from rl.trainer.main import prune_run_files


def make_steps(root, steps):
    for s in steps:
        (root / f"step_{s}").mkdir(parents=True)
        mark_stable(root / f"step_{s}")


def test_old_rollouts_and_weights_go_checkpointed_weights_stay(tmp_path):
    paths = RunPaths(tmp_path)
    make_steps(paths.rollouts_root, range(0, 8))  # the orchestrator is ahead: step 7 is not trained yet
    make_steps(paths.weights_root, range(1, 7))  # step 5 just published weights/step_6
    (paths.checkpoint(2) / "trainer").mkdir(parents=True)
    prune_run_files(paths, 5, TrainerConfig(keep_rollouts=2, keep_weights=3))
    assert sorted(int(p.name[5:]) for p in paths.rollouts_root.iterdir()) == [4, 5, 6, 7]
    assert sorted(int(p.name[5:]) for p in paths.weights_root.iterdir()) == [2, 4, 5, 6]
