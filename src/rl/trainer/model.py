"""Load the policy (and the frozen reference model when the KL penalty is on), sharded with FSDP2 one
transformer block at a time, and compute per-token logprobs and entropies (in chunks: trainer/output_head.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rl.config import local_model_dir
from rl.safetensors_io import read_file_header, read_rows
from rl.trainer.attention import PACKED_SDPA, transformers_attention
from rl.trainer.output_head import DEFAULT_CHUNK_TOKENS, LogprobHead, TeacherTopK, install_logprob_head

from rl.trainer.config import LoraConfig, TrainerConfig
from rl.trainer.data import MicroBatch
from rl.trainer.linear_attention import has_linear_attention, separate_samples
from rl.trainer.lora import apply_lora, init_lora, lora_parameter_names
from rl.trainer.moe import route_as, use_routed_experts
from rl.trainer.vision import is_vision_language, language_model, prepare_vision, vision_forward_inputs
from rl.trainer.world import World


def load_policy(config: TrainerConfig, world: World) -> torch.nn.Module:
    whole = world.world_size == 1  # see shard()
    model = load_model(config.model.name, config.dtype, world, config.attn_implementation, whole,
                       config.logprob_chunk_tokens, config.lora, config.seed, config.compile, config.train_vision)
    return prepare_for_training(model, config.activation_checkpointing)


def prepare_for_training(model: torch.nn.Module, activation_checkpointing: bool) -> torch.nn.Module:
    """Training mode (from_pretrained returns eval mode, and transformers recomputes activations only in
    training mode), optionally recomputing each block's activations in backward instead of keeping them."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def load_reference(config: TrainerConfig, world: World, policy: torch.nn.Module) -> torch.nn.Module | None:
    """The base model, frozen and sharded like the policy; only when the KL penalty is on. With LoRA the policy
    itself, which computes the base model with its adapters disabled (trainer/step.py): no second copy."""
    if config.loss.beta == 0:
        return None
    if config.lora is not None:
        return policy
    model = load_model(config.model.name, config.dtype, world, config.attn_implementation,
                       chunk=config.logprob_chunk_tokens, compile_blocks=config.compile)
    return model.requires_grad_(False).eval()


def load_model(
    name: str, dtype: str, world: World, attn_implementation: str = "sdpa", whole: bool = False,
    chunk: int = DEFAULT_CHUNK_TOKENS, lora: LoraConfig | None = None, seed: int = 0, compile_blocks: bool = False,
    train_vision: bool = False,
) -> torch.nn.Module:
    """A Hugging Face causal LM with fp32 parameters and a `LogprobHead` (and LoRA layers, frozen base), sharded
    over the world. It is built on the meta device and sharded first; then each rank reads only its own rows of
    every tensor from the safetensors files, so no rank ever holds the whole model."""
    model = meta_model(name, transformers_attention(attn_implementation, compile_blocks, world.device), chunk)
    if train_vision and world.world_size > 1:
        raise ValueError("train_vision takes one trainer rank: a rank whose micro-batch holds no image would leave "
                         "the vision tower's gradients out of the reduction the others join")
    prepare_vision(model, train_vision)
    if lora is not None:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    if compile_blocks:
        compile_each_block(model)
    shard(model, world, dtype, whole)
    model.to_empty(device=world.device)
    load_local_rows(model, Path(local_model_dir(name)), world, not_in_files=lora_parameter_names(model))
    init_non_persistent_buffers(model)
    if lora is not None:
        init_lora(model, seed)
    return model


def meta_model(name: str, attn_implementation: str = "sdpa", chunk: int = DEFAULT_CHUNK_TOKENS) -> torch.nn.Module:
    """The model's modules on the meta device (no memory, no file read but config.json), fp32, with a LogprobHead,
    an MoE's experts under their checkpoint names (trainer/moe.py) and linear attention that keeps packed samples
    apart (trainer/linear_attention.py)."""
    config = AutoConfig.from_pretrained(name)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
        use_routed_experts(model)
    separate_samples(model)
    install_logprob_head(model, chunk)
    return model


def compile_each_block(model: torch.nn.Module) -> None:
    """torch.compile every transformer block in place (`Module.compile`: parameter names, and so checkpoints and
    published weights, stay as they are), before FSDP wraps it: its gather and reshard hooks stay eager. The
    blocks share one compiled graph; new row lengths recompile once, to dynamic shapes."""
    for block in language_model(model).layers:
        block.compile()


def local_rows(tensor: torch.Tensor, world: World) -> tuple[int, int]:
    """The rows [start, end) of dim 0 this rank holds: FSDP2 shards dim 0 in chunks of ceil(rows / world size)."""
    rows = tensor.shape[0]
    if not isinstance(tensor, DTensor):
        return 0, rows
    chunk = -(-rows // world.world_size)
    start = min(world.rank * chunk, rows)
    return start, min(start + chunk, rows)


def load_local_rows(
    model: torch.nn.Module, directory: Path, world: World, not_in_files: set[str] = frozenset()
) -> None:
    """Fill this rank's part of every parameter and persistent buffer from the model directory's safetensors files,
    reading only its rows (pread, no mapping: the rank's memory holds its shard and one slice at a time). A tensor
    of the model that no file holds is an error, but for `not_in_files` (LoRA's A and B)."""
    state = model.state_dict()
    loaded = set()
    with torch.no_grad():
        for file in sorted(directory.glob("*.safetensors")):
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                header, data_start = read_file_header(fd, str(file))
                for name in sorted(header.keys() & state.keys()):
                    target = state[name]
                    local = target.to_local() if isinstance(target, DTensor) else target
                    start, end = local_rows(target, world)
                    if local.ndim and local.shape[0] != end - start:
                        raise RuntimeError(
                            f"{name}: rank {world.rank} holds {tuple(local.shape)}, expected rows {start}:{end}"
                        )
                    local.copy_(read_rows(fd, header, data_start, name, start, end))
                    loaded.add(name)
            finally:
                os.close(fd)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(state) - loaded - tied - not_in_files)
    if missing:
        raise ValueError(f"{directory} holds no tensor for {missing[:5]} ({len(missing)} missing)")


def init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Buffers that are not saved (rotary inverse frequencies) are computed by the model, as transformers does when
    it loads from the meta device; each must come out finite."""
    for module in model.modules():
        buffers = [name for name in module._buffers if name in module._non_persistent_buffers_set]
        if buffers:
            model._init_weights(module)
            for name in buffers:
                if not torch.isfinite(getattr(module, name)).all():
                    raise RuntimeError(
                        f"{type(module).__name__}.{name} was not initialized after loading on the meta device"
                    )


def shard(model: torch.nn.Module, world: World, dtype: str, whole: bool) -> None:
    """fully_shard every transformer block, then the root; parameters stay fp32 (master weights) and the
    world decides whether computation runs in bf16 with fp32 gradient reduction.

    `whole`: the policy on one rank. Per-block groups pay off by gathering one block at a time (memory) and
    overlapping communication with compute; one rank has neither, only each group's hooks on every pass.
    So the model is one group that stays gathered through the step (trainer/step.py reshards it after the
    step's last backward)."""
    mp_policy = world.mixed_precision(dtype)
    if whole:
        fully_shard(model, mesh=world.mesh, mp_policy=mp_policy, reshard_after_forward=False)
        return
    for block in language_model(model).layers:  # a vision tower stays in the root's group (trainer/vision.py)
        fully_shard(block, mesh=world.mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=world.mesh, mp_policy=mp_policy)


def forward_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy (no gradient) of every token of the micro-batch, [B, T] each (`forward_scores`)."""
    logprobs, entropy, _ = forward_scores(model, mb, temperature)
    return logprobs, entropy


def forward_scores(
    model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0, teacher: TeacherTopK | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob, entropy (no gradient) and the KL to the `teacher`'s top-k ([B, T, k], position t's the prediction of
    token t; 0 without one) of every token of the micro-batch, [B, T] each, under the distribution the
    tokens were sampled from (logits / temperature in fp32, as vLLM's processed logprobs), computed by the model's
    `LogprobHead` in chunks (trainer/output_head.py): no [B, T, V] tensor is built. Position 0 (no prefix) gets 0;
    in packed rows the first token of each sample is predicted from the previous sample: its loss mask is always 0.
    No KV cache: with one, transformers would not detect the packed samples from the position ids and attention
    would cross them."""
    head = model.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        raise TypeError(
            f"{type(model).__name__} has no LogprobHead: call install_logprob_head(model, chunk) before sharding"
        )
    targets = torch.roll(mb.input_ids, -1, dims=1)  # [B, T]: token t + 1 (the last position's is discarded)
    apart = model.config._attn_implementation == PACKED_SDPA or has_linear_attention(model)
    packed = {"sample_lengths": mb.sample_lengths} if apart else {}
    routed = mb.routed_experts if mb.routed_experts is not None and mb.routed_experts.numel() else None
    tokens = None if mb.attention_mask is None else mb.attention_mask.bool()
    route_as(model, routed, tokens, count=torch.is_grad_enabled())  # an MoE's routing (replayed), if any
    inputs = {"position_ids": mb.position_ids}
    if mb.pixel_values is not None:
        inputs = vision_forward_inputs(model, mb.input_ids, mb.position_ids, mb.sample_lengths, mb.pixel_values,
                                       mb.image_grid_thw)
    with head.scoring(targets, temperature, None if teacher is None else teacher.shifted()):
        scored = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **inputs, **packed,
        ).logits  # [B, T, 3]
    pad = torch.zeros_like(scored[:, :1, 0])
    return tuple(torch.cat([pad, scored[:, :-1, i]], 1) for i in range(3))  # [B, T] each
