"""Trainer configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import CkptConfig, ModelConfig, Section, Settings, WandbConfig


class OptimConfig(Section):
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate")] = 1e-5
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], Field(description="AdamW betas")] = (0.9, 0.999)
    max_grad_norm: Annotated[float, Field(gt=0, description="clip the global gradient norm to this")] = 1.0


class LossConfig(Section):
    eps_low: Annotated[float, Field(ge=0, lt=1, description="lower clip: ratio >= 1 - eps_low")] = 0.2
    eps_high: Annotated[float, Field(ge=0, description="upper clip (clip-higher): ratio <= 1 + eps_high")] = 0.28


class TrainerConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_TRAINER__")

    model: ModelConfig = ModelConfig()
    output_dir: Annotated[Path, Field(description="run directory shared with the other processes")] = Path("outputs/run")
    max_steps: Annotated[int, Field(ge=1, description="train until this many optimizer steps are done")] = 10
    seq_len: Annotated[int, Field(ge=16, description="longest sample (prompt + completion) in tokens")] = 2048
    micro_batch_size: Annotated[int, Field(ge=1, description="samples per forward/backward pass")] = 8
    dtype: Annotated[
        Literal["float32", "bfloat16"], Field(description="parameter dtype (float32 on CPU: bf16 is emulated there)")
    ] = "float32"
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    ckpt: CkptConfig = CkptConfig()
    wandb: WandbConfig = WandbConfig()
    rollout_timeout_s: Annotated[
        float, Field(gt=0, description="deadline for the orchestrator's batch of a step to appear")
    ] = 900.0
    seed: Annotated[int, Field(description="seed for torch RNGs")] = 0

    @model_validator(mode="after")
    def _check(self):
        if self.dtype == "bfloat16" and not _cuda_available():
            raise ValueError("trainer.dtype = 'bfloat16' needs a GPU; use 'float32' on CPU hosts")
        return self


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
