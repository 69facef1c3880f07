"""Trainer configuration (the loss's: trainer/loss_config.py). Variants (LR schedule, transfer) are discriminated
unions on `type`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field
from pydantic_settings import SettingsConfigDict

from rl.adapter import DEFAULT_TARGETS, VLLM_MAX_RANKS
from rl.config import CkptConfig, ConfigError, ModelConfig, Section, Settings, WandbConfig, optional_section
from rl.trainer.loss_config import AutoMismatchCorrection, LossConfig, MaskRatio, NoMismatchCorrection
from rl.weights.config import FilesTransfer, TransferConfig


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
    offload: Annotated[
        bool,
        Field(description="keep AdamW's moments (8 bytes per trained parameter) in host memory between steps, "
                          "copied to the device for each optimizer step: the device holds them only during the "
                          "step, not beside the activations of forward/backward"),
    ] = False


class LoraConfig(Section):
    """Train a LoRA adapter instead of the full weights: the base model is frozen; each step publishes the
    adapter (PEFT layout), which inference serves in place over the base model."""

    rank: Annotated[int, Field(ge=1, le=VLLM_MAX_RANKS[-1], description="rank r of every adapter matrix")] = 16
    alpha: Annotated[float, Field(gt=0, description="scale: the update is (alpha / rank) B A")] = 32.0
    dropout: Annotated[float, Field(ge=0, lt=1, description="dropout on the adapter's input (training only)")] = 0.0
    target_modules: Annotated[
        list[str], Field(min_length=1, description="linear layers to adapt, by name or name suffix (PEFT's rule); "
                                                   "each must match at least one layer")
    ] = list(DEFAULT_TARGETS)
    publish_merged: Annotated[
        bool, Field(description="publish merged full weights (W + scaled B A) each step instead of the adapter, for "
                                "servers that cannot load adapters (inference then runs without LoRA)")
    ] = False


class TrainerConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_TRAINER__")

    model: ModelConfig = ModelConfig()
    output_dir: Annotated[
        Path, Field(description="run directory shared with the other processes")
    ] = Path("outputs/run")
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
        Literal["auto", "float32", "bfloat16"],
        Field(description="compute dtype; bfloat16 (GPU only) computes in bf16 with fp32 master weights and fp32 "
                          "gradient reduction; auto: bfloat16 on CUDA, float32 on CPU"),
    ] = "auto"
    activation_checkpointing: Annotated[
        bool | None,
        Field(description="recompute each transformer block's activations in backward (saves memory); "
                          "unset: on with CUDA, off on CPU"),
    ] = None
    attn_implementation: Annotated[
        Literal["sdpa", "eager", "flex_attention"],
        Field(description="attention kernel; sdpa: torch's; on CPU each sample of a packed row is attended on its "
                          "own (only pairs within a sample are computed), on GPU and with compile transformers' sdpa "
                          "computes every pair of the row under a block-diagonal mask, as eager does; "
                          "flex_attention skips the mask's empty blocks (GPU)"),
    ] = "sdpa"
    compile: Annotated[
        bool,
        Field(description="torch.compile each transformer block (in place, before FSDP wraps it), as prime-rl's "
                          "[model.compile]; the first steps pay the compile (and one recompile to dynamic shapes "
                          "when row lengths vary)"),
    ] = False
    publish_in_background: Annotated[
        bool,
        Field(description="write weights/step_k/ in a writer thread while the next step trains (rank 0 holds one "
                          "more copy of the weights); the directory still appears only once complete"),
    ] = False
    logprob_chunk_tokens: Annotated[
        int, Field(ge=1, description="tokens per chunk of the output layer's logprob/entropy (the [chunk, vocab] "
                                     "logits are the largest tensors it builds; backward recomputes them)")
    ] = 1024
    publish_shard_gib: Annotated[
        float, Field(gt=0, description="largest safetensors shard of weights/step_k/; shards are written by every rank "
                                       "in parallel (shard i by rank i mod world size)")
    ] = 5.0
    publish_dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(description="dtype of weights/step_k/, which must be the dtype inference serves (rl sets it from "
                          "inference.dtype); auto: float32 on CPU, on CUDA what vLLM's --dtype auto serves for the "
                          "model. A trainer started alone beside a server with an explicit dtype needs the same here"),
    ] = "auto"
    temperature: Annotated[
        float, Field(gt=0, description="sampling temperature of the rollouts (set by rl from the orchestrator's)")
    ] = 1.0
    train_vision: Annotated[
        bool, Field(description="a vision-language model: train its vision tower too (frozen by default; one "
                                "trainer rank, where a rank without images would leave its gradients out)")
    ] = False
    lora: Annotated[
        LoraConfig | None, BeforeValidator(optional_section),
        Field(description="train a LoRA adapter (`--trainer.lora`, `--trainer.lora.rank 8` ...); unset: full weights"),
    ] = None
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    ckpt: CkptConfig = CkptConfig()
    wandb: WandbConfig = WandbConfig()
    transfer: TransferConfig = FilesTransfer()
    batch_timeout_s: Annotated[
        float, Field(gt=0, description="deadline for the orchestrator's batch of a step to appear")
    ] = 900.0
    keep_rollouts: Annotated[int, Field(ge=1, description="newest trained rollout batches kept on disk")] = 2
    keep_weights: Annotated[
        int,
        Field(ge=2, description="newest weight steps kept on disk besides checkpointed ones; inference may serve, "
                                "or roll back to, a step async_level + 1 old, so at least async_level + 2"),
    ] = 4
    seed: Annotated[int, Field(description="seed for torch RNGs")] = 0
    deterministic: Annotated[
        bool, Field(description="torch's deterministic algorithms only (slower on GPUs): bitwise-equal runs and "
                                "replays there too (CPU kernels are deterministic already)")
    ] = False
    resume_step: Annotated[
        int | None,
        Field(ge=1, description="load checkpoints/step_k/trainer and continue at step k; unset: start from step 0"),
    ] = None

    @property
    def row_tokens(self) -> int:
        """Capacity of one packed micro-batch. Not validated against seq_len: `rl` fills seq_len after
        the process configs are parsed."""
        return max(self.micro_batch_tokens or 0, self.seq_len)


DeviceKind = Literal["cuda", "cpu"]

# vLLM 0.32 refuses float16 for these model types (numerical instability): `--dtype auto` serves bfloat16.
VLLM_NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})


DEVICE_FIELDS = ("dtype", "activation_checkpointing", "loss.mismatch", "publish_dtype", "transfer.way")


def resolve_device_defaults(config: TrainerConfig, device: DeviceKind) -> dict[str, str]:
    """Fill, in place, the fields left to the device ("auto" or unset); a value the user set is kept.

    CUDA: bf16 compute (fp32 master weights and gradient reduction), activation checkpointing, the mismatch
    mask, weights published in what vLLM's `--dtype auto` serves. CPU: float32 throughout, no checkpointing
    (bf16 is emulated on these CPUs), no mismatch correction (both sides compute in float32). Returns
    {field: why} for every device-dependent field (dotted below the trainer's section), for `rl --dry-run`."""
    on_cuda = device == "cuda"
    why = {}
    if config.dtype == "auto":
        config.dtype, why["dtype"] = ("bfloat16" if on_cuda else "float32"), f"auto: {device.upper()}"
    if config.activation_checkpointing is None:
        config.activation_checkpointing, why["activation_checkpointing"] = on_cuda, f"auto: {device.upper()}"
    if isinstance(config.loss.mismatch, AutoMismatchCorrection):
        # not the geometric sequence mask peers add: rl's ratios hold the policy's steps since sampling too, and at
        # SkyRL's [0.99, 1.01] it masked 91-95% of an async run's sequences (benchmarks/RESULTS.md, off_policy.py)
        config.loss.mismatch = [MaskRatio()] if on_cuda else NoMismatchCorrection()
        why["loss.mismatch"] = f"auto: {device.upper()}"
    if config.publish_dtype == "auto":
        if on_cuda:
            config.publish_dtype, served = vllm_auto_dtype(config.model.name)
            why["publish_dtype"] = f"auto: CUDA, what vLLM's --dtype auto serves ({served})"
        else:
            config.publish_dtype, why["publish_dtype"] = "float32", "auto: CPU"
    why["transfer.way"] = config.transfer.resolve_device(device, "trainer")
    return {field: why.get(field, "set by you") for field in DEVICE_FIELDS}


def vllm_auto_dtype(model: str) -> tuple[str, str]:
    """The dtype vLLM 0.32's `--dtype auto` serves `model` in, and why. Mirrors its `_resolve_auto_dtype` on
    platforms with bf16, fp16 and fp32 (CUDA from Ampere on, x86 and aarch64 CPUs): the model's dtype is
    config.json's `dtype` or `torch_dtype` (else its text_config's, else the safetensors weights', else
    float32); float16 and bfloat16 are served as they are, anything else (float32) as bfloat16, and float16
    as bfloat16 for the model types vLLM refuses it for."""
    config = _model_config_json(model)
    text = config.get("text_config") or {}
    stated = next((c[k] for c in (config, text) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    if stated is not None:
        found, source = _dtype_name(stated), f"config.json: {stated}"
    elif (weights := _local_weights_dtype(model)) is not None:
        found, source = weights, f"safetensors weights: {weights}"
    else:
        found, source = "float32", "no dtype in config.json"
    if found == "float16" and config.get("model_type") in VLLM_NO_FLOAT16:
        return "bfloat16", f"{source}, which vLLM refuses for {config['model_type']}"
    return (found if found in ("bfloat16", "float16") else "bfloat16"), source


def _dtype_name(name: object) -> str:
    """'torch.bfloat16', 'half', 'float16' ... -> torch's canonical name ('bfloat16', 'float16')."""
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(name)


def _model_config_json(model: str) -> dict:
    """config.json of a local model directory, or of a hub model (from the local cache when it is there)."""
    import json

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    local = Path(model).expanduser() / "config.json"
    try:
        path = local if local.is_file() else Path(hf_hub_download(model, "config.json"))
        return json.loads(path.read_text())
    except (OSError, ValueError, EntryNotFoundError) as e:  # offline, no such repo or file, not JSON
        raise ConfigError(
            f"cannot read config.json of model {model!r} to find the dtype vLLM's --dtype auto serves ({e}); "
            "set the dtype explicitly (--inference.dtype, or trainer.publish_dtype for a trainer started alone)"
        ) from None


def _local_weights_dtype(model: str) -> str | None:
    """The dtype every tensor of a local model's safetensors files promotes to (None without such files), as
    vLLM reads it when config.json names none."""
    import torch
    from safetensors import safe_open

    common = None
    for path in sorted(Path(model).expanduser().glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:  # reads the header only
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype, torch.float32)
                common = dtype if common is None else torch.promote_types(common, dtype)
    return None if common is None else str(common).removeprefix("torch.")


GPU_DEVICE_NODES = ("nvidia[0-9]*", "dxg", "kfd")  # NVIDIA's, WSL2's, AMD's (ROCm): torch's CUDA API needs one


def cuda_device_count() -> int:
    """This host's GPUs as torch sees them; on a host with no GPU device node, none without importing torch (4-5 s of
    a core on a small CPU host: the launcher asks at every launch)."""
    if not any(any(Path("/dev").glob(node)) for node in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(config: TrainerConfig) -> None:
    """Where the trainer starts (not where a job is rendered): fill the fields left to the device for this
    host's device (`resolve_device_defaults`), then refuse what it cannot run."""
    device = "cuda" if cuda_device_count() else "cpu"
    resolve_device_defaults(config, device)  # the transport too, refused where it cannot run
    if config.dtype == "bfloat16" and device == "cpu":
        raise ConfigError("trainer.dtype = 'bfloat16' needs a GPU; use 'float32' on CPU hosts")
    if config.attn_implementation == "flex_attention" and device == "cpu":
        raise ConfigError("trainer.attn_implementation = 'flex_attention' needs a GPU (torch has no flex attention "
                          "backward on CPU); use 'sdpa' on CPU hosts")
