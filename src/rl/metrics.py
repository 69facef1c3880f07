"""One concise log line per step, the same numbers in metrics.jsonl, and W&B when configured."""

from __future__ import annotations

import logging
import sys
import time
import uuid

from pydantic import BaseModel

from rl.config import WandbConfig, public_config
from rl.metrics_file import append_metrics
from rl.protocol import RunPaths, atomic_write_text


PER_REQUEST_LOGGERS = ("verifiers", "httpx", "httpx2", "mcp", "aiohttp.access")
"""Libraries that log a line per rollout, request or tool call at INFO: warnings and errors only."""


def setup_logging(process: str, quiet: tuple[str, ...] = ()) -> logging.Logger:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {process} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    return logging.getLogger(process)


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def wandb_run_id(paths: RunPaths, process: str) -> str:
    """The W&B run id of `process` in this run directory: made once, kept across resumes."""
    path = paths.wandb_run_id(process)
    if path.is_file():
        return path.read_text().strip()
    run_id = f"{process}-{uuid.uuid4().hex[:12]}"
    atomic_write_text(path, run_id + "\n")
    return run_id


class MetricsLogger:
    """Owns the per-step record of one process: log line, metrics.jsonl row and W&B row."""

    def __init__(self, process: str, paths: RunPaths, wandb_config: WandbConfig, config: BaseModel, logger):
        """`config`: the process's, recorded in W&B without its secrets (`public_config`)."""
        self.process = process
        self.paths = paths
        self.logger = logger
        self.run = None
        if wandb_config.project:
            import wandb

            self.run = wandb.init(
                project=wandb_config.project,
                name=f"{wandb_config.name or paths.root.name}-{process}",
                mode=wandb_config.mode,
                dir=str(paths.root),
                config=public_config(config),
                id=wandb_run_id(paths, process),
                resume="allow",  # a resumed run continues the same W&B run
            )

    def log(self, step: int, metrics: dict, line_keys: tuple[str, ...]) -> None:
        record = {"process": self.process, "step": step, "time": time.time(), **metrics}
        append_metrics(self.paths, record)
        shown = " ".join(f"{k}={_format(metrics[k])}" for k in line_keys if k in metrics)
        self.logger.info(f"step {step} | {shown}")
        if self.run is not None:
            self.run.log({f"{self.process}/{k}": v for k, v in metrics.items()}, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table of rows (e.g. sample completions) under `<process>/<name>` in W&B; no-op without W&B."""
        if self.run is None:
            return
        import wandb

        self.run.log({f"{self.process}/{name}": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
