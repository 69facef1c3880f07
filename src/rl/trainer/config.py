"""Trainer configuration. Variants (loss normalisation, mismatch correction, LR schedule) are
discriminated unions on `type`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rl.config import CkptConfig, ConfigError, ModelConfig, Section, Settings, WandbConfig


class OptimConfig(Section):
    lr: Annotated[float, Field(gt=0, description="AdamW peak learning rate")] = 1e-5
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], Field(description="AdamW betas")] = (0.9, 0.999)
    max_grad_norm: Annotated[float, Field(gt=0, description="clip the global gradient norm to this")] = 1.0
    schedule: Annotated[
        Literal["constant", "linear", "cosine"],
        Field(description="LR after warmup: constant, linear decay or cosine decay to min_lr_ratio * lr at max_steps"),
    ] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, description="linear warmup from 0 to lr over this many steps")] = 0
    min_lr_ratio: Annotated[
        float, Field(ge=0, le=1, description="linear/cosine: final LR as a fraction of lr")
    ] = 0.0


class DapoNorm(Section):
    """sum over every trained token of the step / number of those tokens (all ranks, all micro-batches)."""

    type: Annotated[Literal["dapo"], Field(description="token-level mean over the whole step")] = "dapo"


class GrpoNorm(Section):
    """mean over each sample's trained tokens, then mean over the step's samples."""

    type: Annotated[Literal["grpo"], Field(description="per-sample token mean, then mean over samples")] = "grpo"


class DrGrpoNorm(Section):
    """sum over every trained token / (samples in the step * tokens_per_sample), a constant per step shape."""

    type: Annotated[Literal["dr_grpo"], Field(description="token sum over a constant (Dr. GRPO)")] = "dr_grpo"
    tokens_per_sample: Annotated[
        int | None, Field(ge=1, description="denominator per sample (max completion tokens); unset: seq_len")
    ] = None


NormConfig = Annotated[Union[DapoNorm, GrpoNorm, DrGrpoNorm], Field(discriminator="type")]


class NoMismatchCorrection(Section):
    type: Annotated[Literal["none"], Field(description="no train-inference mismatch correction")] = "none"


class TruncateRatio(Section):
    """Truncated importance weights: the ratio is capped at `cap` (bounds negative-advantage tokens)."""

    type: Annotated[Literal["truncate"], Field(description="cap the importance ratio at `cap`")] = "truncate"
    cap: Annotated[float, Field(gt=1, description="largest importance ratio a token may carry")] = 2.0


class MaskRatio(Section):
    """Tokens whose |log ratio| exceeds `max_log_ratio` contribute nothing to the loss."""

    type: Annotated[Literal["mask"], Field(description="drop tokens with |log ratio| > max_log_ratio")] = "mask"
    max_log_ratio: Annotated[float, Field(gt=0, description="bound on |log pi_theta - log pi_old|")] = 1.0


MismatchConfig = Annotated[
    Union[NoMismatchCorrection, TruncateRatio, MaskRatio], Field(discriminator="type")
]


class LossConfig(Section):
    eps_low: Annotated[float, Field(ge=0, lt=1, description="lower clip: ratio >= 1 - eps_low")] = 0.2
    eps_high: Annotated[float, Field(ge=0, description="upper clip (clip-higher): ratio <= 1 + eps_high")] = 0.28
    norm: Annotated[NormConfig, Field(description="how token losses are normalised (type = dapo|grpo|dr_grpo)")] = (
        DapoNorm()
    )
    mismatch: Annotated[
        MismatchConfig, Field(description="train-inference mismatch correction (type = none|truncate|mask)")
    ] = NoMismatchCorrection()
    beta: Annotated[
        float, Field(ge=0, description="KL penalty (k3) to the reference (base) model; 0 loads no reference")
    ] = 0.0


class TrainerConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_TRAINER__")

    model: ModelConfig = ModelConfig()
    output_dir: Annotated[Path, Field(description="run directory shared with the other processes")] = Path("outputs/run")
    max_steps: Annotated[int, Field(ge=1, description="train until this many optimizer steps are done")] = 10
    seq_len: Annotated[int, Field(ge=16, description="longest sample (prompt + completion) in tokens")] = 2048
    micro_batch_size: Annotated[int, Field(ge=1, description="padding only: samples per forward/backward pass")] = 8
    micro_batch_tokens: Annotated[
        int | None,
        Field(ge=16, description="packing: tokens per forward/backward pass, several samples in one row; raised to "
                                 "seq_len if smaller (a sample must fit); unset: seq_len. Fewer, larger passes "
                                 "amortise per-pass costs (FSDP gathers, Python) when samples are short"),
    ] = None
    packing: Annotated[
        bool,
        Field(description="pack samples into rows of at most seq_len tokens (no cross-sample attention); else pad"),
    ] = True
    dtype: Annotated[
        Literal["float32", "bfloat16"],
        Field(description="parameter dtype; bfloat16 (GPU only) keeps bf16 params with fp32 gradient reduction"),
    ] = "float32"
    activation_checkpointing: Annotated[
        bool, Field(description="recompute each transformer block's activations in backward (saves memory)")
    ] = False
    attn_implementation: Annotated[
        Literal["sdpa", "eager", "flex_attention"],
        Field(description="transformers attention kernel; with packing, sdpa and eager compute every pair of a "
                          "row's tokens under a block-diagonal mask, flex_attention skips the empty blocks (GPU)"),
    ] = "sdpa"
    publish_in_background: Annotated[
        bool,
        Field(description="write weights/step_k/ in a writer thread while the next step trains (rank 0 holds one "
                          "more copy of the weights); the directory still appears only once complete"),
    ] = False
    publish_shard_gib: Annotated[
        float, Field(gt=0, description="largest safetensors shard of weights/step_k/; shards are written by every rank "
                                       "in parallel (shard i by rank i mod world size)")
    ] = 5.0
    temperature: Annotated[
        float, Field(gt=0, description="sampling temperature of the rollouts (set by rl from the orchestrator's)")
    ] = 1.0
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    ckpt: CkptConfig = CkptConfig()
    wandb: WandbConfig = WandbConfig()
    rollout_timeout_s: Annotated[
        float, Field(gt=0, description="deadline for the orchestrator's batch of a step to appear")
    ] = 900.0
    keep_rollouts: Annotated[int, Field(ge=1, description="newest trained rollout batches kept on disk")] = 2
    keep_weights: Annotated[
        int,
        Field(ge=2, description="newest weight steps kept on disk besides checkpointed ones; inference may serve, "
                                "or roll back to, a step async_level + 1 old, so at least async_level + 2"),
    ] = 4
    seed: Annotated[int, Field(description="seed for torch RNGs")] = 0
    resume_step: Annotated[
        int | None,
        Field(ge=1, description="load checkpoints/step_k/trainer and continue at step k; unset: start from step 0"),
    ] = None

    @property
    def row_tokens(self) -> int:
        """Capacity of one packed micro-batch. Not validated against seq_len: `rl` fills seq_len after
        the process configs are parsed."""
        return max(self.micro_batch_tokens or 0, self.seq_len)


def check_device(config: TrainerConfig) -> None:
    """What this host's devices cannot run; checked where the trainer starts (not where a job is rendered)."""
    import torch

    if config.dtype == "bfloat16" and not torch.cuda.is_available():
        raise ConfigError("trainer.dtype = 'bfloat16' needs a GPU; use 'float32' on CPU hosts")
