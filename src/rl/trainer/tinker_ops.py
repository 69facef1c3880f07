"""Tinker's forward/backward on rl's model: datums into packed micro-batches, its built-in losses, each datum's
target logprobs back.

A datum is N input tokens x and, per position i, loss inputs aligned with them: `target_tokens` y_i (the token
position i predicts), and by loss `weights` w_i, the sampler's `logprobs` q_i, `advantages` A_i. With the learner's
l_i = log pi_theta(y_i | x_<=i) and r_i = exp(l_i - q_i), summed over every position of every datum:

    cross_entropy         L = -sum w_i l_i
    importance_sampling   L = -sum r_i A_i
    ppo                   L = -sum min(r_i A_i, clip(r_i, lo, hi) A_i)          lo, hi: clip_low/high_threshold
    cispo                 L = -sum sg(clip(r_i, lo, hi)) l_i A_i                 (defaults 0.8 and 1.2)

rl's model scores the next input token, so y must be x shifted by one (y_i = x_{i+1}); the last target extends the
sequence. A datum whose targets are not is refused by name."""

from __future__ import annotations

from dataclasses import replace

import torch

from rl.samples import Sample
from rl.trainer.data import MicroBatch, empty_micro_batch, pack_rows, packed_micro_batch
from rl.trainer.model import forward_logprobs
from rl.trainer.step import set_gradient_sync
from rl.trainer.world import World

LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


class CallError(ValueError):
    """A call the trainer refuses, its message naming why (the client's error, not the trainer's)."""


class ModelLost(CallError):
    """A call for a model a restarted trainer no longer holds."""


def check_call(loss_fn: str, config: dict[str, float], datums: list[dict[str, torch.Tensor]], seq_len: int,
               vocab_size: int) -> None:
    if loss_fn not in LOSS_INPUTS:
        raise CallError(f"loss_fn {loss_fn!r} is not one rl serve-api computes; it computes "
                        f"{sorted(LOSS_INPUTS)}")
    if unknown := set(config) - set(CLIP_DEFAULTS):
        raise CallError(f"loss_fn_config keys {sorted(unknown)} are unknown to {loss_fn}; rl reads "
                        f"{sorted(CLIP_DEFAULTS)}")
    for i, datum in enumerate(datums):
        tokens = datum["tokens"]
        if missing := [k for k in LOSS_INPUTS[loss_fn] if k not in datum]:
            raise CallError(f"datum {i} lacks loss_fn_inputs {missing} that {loss_fn} needs")
        if not len(tokens):
            raise CallError(f"datum {i} has no input token")
        if len(tokens) + 1 > seq_len:
            raise CallError(f"datum {i} holds {len(tokens)} tokens and its last target; the trainer's seq_len is "
                            f"{seq_len}")
        targets = datum["target_tokens"]
        if (outside := torch.cat([tokens, targets[-1:]])).min() < 0 or outside.max() >= vocab_size:
            raise CallError(f"datum {i} holds token ids outside the model's vocabulary of {vocab_size}: "
                            f"{sorted({int(t) for t in outside if not 0 <= t < vocab_size})[:5]}")
        if not torch.equal(targets[:-1], tokens[1:]):
            bad = int((targets[:-1] != tokens[1:]).nonzero()[0])
            raise CallError(f"datum {i}: target_tokens[{bad}] = {int(targets[bad])} is not model_input[{bad + 1}] = "
                            f"{int(tokens[bad + 1])}; rl scores each next input token, so targets must be the inputs "
                            "shifted by one")


def datum_sample(datum: dict[str, torch.Tensor]) -> Sample:
    """The datum as one sequence x + [y_last]: position i + 1 holds target i."""
    ids = datum["tokens"].tolist() + [int(datum["target_tokens"][-1])]
    sampled = datum.get("logprobs", torch.zeros(len(ids) - 1)).tolist()
    return Sample(ids, [0] + [1] * (len(ids) - 1), [0.0] + sampled, 0.0, 0.0, 0)


def per_token(datum: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Input `name` aligned with the sequence (0 at position 0, which predicts nothing)."""
    values = datum.get(name, torch.zeros(len(datum["tokens"])))
    return torch.cat([torch.zeros(1), values.float()])


def micro_batches(datums: list[dict[str, torch.Tensor]], row_tokens: int) -> list[tuple[MicroBatch, list[int]]]:
    """Packed rows of datums; each with the datum indices it holds, in row order. `weights` carries the
    cross-entropy weights, `advantages` the advantages, `old_logprobs` the sampler's logprobs."""
    samples = [datum_sample(d) for d in datums]
    batches = []
    for row in pack_rows([len(s.input_ids) for s in samples], row_tokens):
        mb = packed_micro_batch([samples[i] for i in row], [0.0] * len(row))
        weights = torch.cat([per_token(datums[i], "weights") for i in row]).unsqueeze(0)
        advantages = torch.cat([per_token(datums[i], "advantages") for i in row]).unsqueeze(0)
        batches.append((replace(mb, weights=weights, advantages=advantages), row))
    return batches


def tinker_loss(loss_fn: str, logprobs: torch.Tensor, mb: MicroBatch, config: dict[str, float]) -> torch.Tensor:
    """L of the module docstring over one micro-batch ([B, T] tensors; untrained positions hold 0 inputs)."""
    mask = mb.loss_mask.to(logprobs.dtype)
    if loss_fn == "cross_entropy":
        return -(logprobs * mb.weights * mask).sum()
    ratio = torch.exp(logprobs - mb.old_logprobs)
    low = config.get("clip_low_threshold", CLIP_DEFAULTS["clip_low_threshold"])
    high = config.get("clip_high_threshold", CLIP_DEFAULTS["clip_high_threshold"])
    if loss_fn == "importance_sampling":
        per_position = ratio * mb.advantages
    elif loss_fn == "ppo":
        per_position = torch.minimum(ratio * mb.advantages, ratio.clamp(low, high) * mb.advantages)
    else:  # cispo
        per_position = ratio.detach().clamp(low, high) * logprobs * mb.advantages
    return -(per_position * mask).sum()


def forward_backward(policy, datums: list[dict[str, torch.Tensor]], loss_fn: str, config: dict[str, float],
                     backward: bool, row_tokens: int, pad_id: int, world: World
                     ) -> tuple[dict[int, torch.Tensor], float]:
    """This rank's datums' target logprobs ([N] each, by datum index in `datums`) and its part of the loss. Every
    rank runs as many micro-batches (FSDP's collectives must match): a rank with fewer runs empty ones."""
    batches = micro_batches(datums, row_tokens)
    count, = world.all_reduce([len(batches)], op="max")
    batches += [(empty_micro_batch(pad_id, True), [])] * (int(count) - len(batches))
    outputs, total = {}, 0.0
    for i, (mb, row) in enumerate(batches):
        if backward and i in (0, len(batches) - 1):  # gradients reduced by the call's last backward (as step.py)
            set_gradient_sync(policy, world, last=i == len(batches) - 1)
        mb = mb.to(world.device)
        with torch.set_grad_enabled(backward):
            logprobs, _ = forward_logprobs(policy, mb)
            loss = tinker_loss(loss_fn, logprobs, mb, config)
            if backward:  # FSDP averages gradients over ranks: the loss is a sum over all of them
                (loss * world.world_size).backward()
        total += float(loss.detach())
        offset = 0
        for i in row:
            n = len(datums[i]["tokens"])
            outputs[i] = logprobs[0, offset + 1: offset + n + 1].detach().float().cpu()
            offset += n + 1
    return outputs, total
