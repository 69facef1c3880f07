import logging

from rl.config import WandbConfig
from rl.metrics import MetricsLogger, wandb_run_id
from rl.protocol import RunPaths, read_metrics
from rl.trainer.config import TrainerConfig


def test_wandb_run_id_is_kept_per_process(tmp_path):
    paths = RunPaths(tmp_path)
    first = wandb_run_id(paths, "trainer")
    assert wandb_run_id(paths, "trainer") == first
    assert wandb_run_id(paths, "orchestrator") != first


def test_a_resumed_process_continues_its_wandb_run(tmp_path):
    """Offline W&B: the second logger (as after a resume) writes into the run the first one made."""
    paths = RunPaths(tmp_path)
    config = WandbConfig(project="rl-test", mode="offline")
    for step in (0, 1):
        metrics = MetricsLogger("trainer", paths, config, TrainerConfig(), logging.getLogger("test"))
        metrics.log(step, {"loss": 0.5}, ("loss",))
        metrics.close()
    run_id = wandb_run_id(paths, "trainer")
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run_id in name for name in runs), runs  # W&B adds -1 on a same-second name
    assert [m["step"] for m in read_metrics(paths)] == [0, 1]
