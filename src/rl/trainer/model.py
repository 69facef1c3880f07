"""Load the policy (and the frozen reference model when the KL penalty is on), sharded with FSDP2 one
transformer block at a time, and compute per-token logprobs and entropies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from rl.trainer.config import TrainerConfig
from rl.trainer.data import MicroBatch
from rl.trainer.world import World


def load_policy(config: TrainerConfig, world: World) -> torch.nn.Module:
    whole = world.world_size == 1  # see shard()
    model = load_model(config.model.name, config.dtype, world, config.attn_implementation, whole)
    return prepare_for_training(model, config.activation_checkpointing)


def prepare_for_training(model: torch.nn.Module, activation_checkpointing: bool) -> torch.nn.Module:
    """Training mode (from_pretrained returns eval mode, and transformers recomputes activations only in
    training mode), optionally recomputing each block's activations in backward instead of keeping them."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def load_reference(config: TrainerConfig, world: World) -> torch.nn.Module | None:
    """The base model, frozen and sharded like the policy; only when the KL penalty is on."""
    if config.loss.beta == 0:
        return None
    model = load_model(config.model.name, config.dtype, world, config.attn_implementation)
    return model.requires_grad_(False).eval()


def load_model(
    name: str, dtype: str, world: World, attn_implementation: str = "sdpa", whole: bool = False
) -> torch.nn.Module:
    """A Hugging Face causal LM with fp32 parameters, sharded over the world."""
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation=attn_implementation)
    model.to(world.device)
    shard(model, world, dtype, whole)
    return model


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
    for block in model.model.layers:
        fully_shard(block, mesh=world.mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=world.mesh, mp_policy=mp_policy)


def forward_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of every token of the micro-batch, [B, T] each, under the distribution the tokens
    were sampled from (logits / temperature, as vLLM's processed logprobs). No KV cache: with one,
    transformers would not detect the packed samples from the position ids and attention would cross them."""
    logits = model(
        input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask, use_cache=False
    ).logits
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, mb.input_ids)  # logits [B, T, V]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each token given its prefix; position 0 (no prefix) gets 0. In packed rows
    the first token of each sample is predicted from the previous sample: its loss mask is always 0."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T-1]
    pad = torch.zeros_like(picked[:, :1])
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)  # [B, T] each
