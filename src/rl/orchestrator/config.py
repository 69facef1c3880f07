"""Orchestrator configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import CkptConfig, EnvConfig, ModelConfig, Section, Settings, WandbConfig


class SamplingConfig(Section):
    temperature: Annotated[float, Field(ge=0, description="sampling temperature")] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, description="nucleus sampling mass")] = 1.0
    max_tokens: Annotated[int, Field(ge=1, description="most tokens generated per turn")] = 128
    seed: Annotated[int | None, Field(description="sampling seed (per request offset added)")] = None


class ClientConfig(Section):
    base_urls: Annotated[
        list[str], Field(min_length=1, description="inference servers, one per data-parallel replica")
    ] = ["http://127.0.0.1:8000"]
    admin_token: Annotated[str | None, Field(description="bearer token for the servers' admin routes")] = None
    timeout_s: Annotated[float, Field(gt=0, description="deadline for one request to an inference server")] = 300.0
    startup_timeout_s: Annotated[float, Field(gt=0, description="deadline for the servers to become healthy")] = 600.0


class AdvantageConfig(Section):
    type: Annotated[Literal["grpo"], Field(description="grpo: (r - mean) / (std + eps) within the group")] = "grpo"


class OrchestratorConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_ORCHESTRATOR__")

    model: ModelConfig = ModelConfig()
    output_dir: Annotated[Path, Field(description="run directory shared with the other processes")] = Path("outputs/run")
    max_steps: Annotated[int, Field(ge=1, description="write batches for steps 0 .. max_steps - 1")] = 10
    async_level: Annotated[
        int, Field(ge=0, description="batch k uses policies v_j with j >= k - async_level (0 = on-policy)")
    ] = 1
    seq_len: Annotated[int, Field(ge=16, description="longest sample (prompt + completion) in tokens")] = 2048
    env: Annotated[list[EnvConfig], Field(min_length=1, description="environments ([[env]] tables)")] = [
        EnvConfig(id="reverse-text")
    ]
    batch_size: Annotated[int, Field(ge=1, description="rollouts per trainer step")] = 32
    rollouts_per_example: Annotated[int, Field(ge=1, description="group size: rollouts per task")] = 8
    max_concurrent: Annotated[int, Field(ge=1, description="rollouts in flight at once")] = 64
    sampling: SamplingConfig = SamplingConfig()
    client: ClientConfig = ClientConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    trainer_world_size: Annotated[int, Field(ge=1, description="trainer data-parallel ranks (one batch file each)")] = 1
    weights_timeout_s: Annotated[
        float, Field(gt=0, description="deadline for the trainer to publish the weights a step needs")
    ] = 900.0
    ckpt: CkptConfig = CkptConfig()
    wandb: WandbConfig = WandbConfig()
    seed: Annotated[int, Field(description="seed of the task sampler")] = 0

    @model_validator(mode="after")
    def _check(self):
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example})"
            )
        if self.batch_size % self.trainer_world_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of trainer_world_size ({self.trainer_world_size})"
            )
        return self
