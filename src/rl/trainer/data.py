"""Turn a rank's samples into micro-batches the model can consume.

Packing (default): samples are placed first-fit, longest first, into rows of at most `row_tokens` tokens
(`micro_batch_tokens`, or `seq_len`); one row is one micro-batch `[1, T]`. Position ids restart at 0 for
every sample and no attention mask is passed, so transformers detects the packed samples from the position ids
and builds a block-diagonal causal mask (no attention across samples) for sdpa and eager attention alike. The
row also carries its sample lengths, with which rl's sdpa attends each sample on its own (attention.py).

Padding (fallback, `packing = false`): `micro_batch_size` samples per micro-batch, right-padded to the
longest, with an attention mask.

Samples longer than `seq_len` are truncated. Every token carries its sample's advantage and loss weight.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from rl.samples import Sample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T] restarting at 0 for every sample
    attention_mask: torch.Tensor | None  # [B, T] 1 for real tokens; None when packed (no padding)
    loss_mask: torch.Tensor  # [B, T] bool, predicted tokens that are trained on
    old_logprobs: torch.Tensor  # [B, T] inference logprob of token t, aligned with loss_mask
    teacher_logprobs: torch.Tensor  # [B, T] the teacher's logprob of token t; old_logprobs where there is none
    rescored_logprobs: torch.Tensor  # [B, T] inference's under the trained policy (re-scored); old_logprobs if none
    teacher_top_ids: torch.Tensor  # [B, T, k] the teacher's k likeliest tokens at t (k = 0 without them)
    teacher_top_logprobs: torch.Tensor  # [B, T, k] their logprobs
    advantages: torch.Tensor  # [B, T] advantage of each token's sample
    weights: torch.Tensor  # [B, T] loss weight w_i of each token's sample (see loss.py)
    routed_experts: torch.Tensor | None = None  # [B, T, L, k] experts inference routed token t to (-1: none); MoE
    sample_lengths: tuple[int, ...] | None = None  # packed: the row's samples in order (attention.py); else None
    # a vision-language model's images of the micro-batch's samples, in order (trainer/vision.py); None: no image
    pixel_values: torch.Tensor | None = None  # [patches, D]
    image_grid_thw: torch.Tensor | None = None  # [images, 3]

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def truncate(sample: Sample, seq_len: int) -> Sample:
    if len(sample.input_ids) <= seq_len:
        return sample
    if sample.pixel_values is not None:  # the orchestrator leaves out samples longer than its seq_len (the same)
        raise ValueError(f"a sample with images holds {len(sample.input_ids)} tokens, over seq_len {seq_len}: cut, "
                         "its image tokens would no longer match its images")
    per_token = ("input_ids", "loss_mask", "logprobs", "teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs",
                 "token_versions", "routed_experts", "rescored_logprobs")
    return replace(sample, **{name: None if getattr(sample, name) is None else getattr(sample, name)[:seq_len]
                              for name in per_token})


def trained_tokens(sample: Sample) -> int:
    """Tokens of the sample that are trained on (the first token has no prediction)."""
    return sum(sample.loss_mask[1:])


def sample_tensors(sample: Sample, weight: float) -> dict[str, torch.Tensor]:
    """The per-token tensors of one sample, each [T] (the teacher's top-k [T, k])."""
    n = len(sample.input_ids)
    ranked = sample.teacher_top_ids is not None
    loss_mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    loss_mask[0] = False  # the first token has no prediction
    return {
        "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
        "position_ids": torch.arange(n),
        "loss_mask": loss_mask,
        "old_logprobs": torch.tensor(sample.logprobs, dtype=torch.float32),
        # no teacher: the sampling logprobs, so that the distillation term of loss.py is 0 for the sample
        "teacher_logprobs": torch.tensor(sample.teacher_logprobs or sample.logprobs, dtype=torch.float32),
        # none re-scored: the sampling logprobs (train_step refuses a batch without them where a mask reads them)
        "rescored_logprobs": torch.tensor(sample.rescored_logprobs or sample.logprobs, dtype=torch.float32),
        "teacher_top_ids": torch.tensor(sample.teacher_top_ids, dtype=torch.long) if ranked
        else torch.zeros(n, 0, dtype=torch.long),
        "teacher_top_logprobs": torch.tensor(sample.teacher_top_logprobs, dtype=torch.float32) if ranked
        else torch.zeros(n, 0),
        "advantages": torch.full((n,), sample.advantage, dtype=torch.float32),
        "weights": torch.full((n,), weight, dtype=torch.float32),
        "routed_experts": torch.zeros(n, 0, 0, dtype=torch.long) if sample.routed_experts is None
        else sample.routed_experts.long(),
    }


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Indices of the samples in each row: first fit, longest first; every length must be <= row_tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, space in enumerate(free) if space >= lengths[i]), None)
        if row is None:
            rows.append([])
            free.append(row_tokens)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def packed_micro_batch(samples: list[Sample], weights: list[float]) -> MicroBatch:
    """One row [1, T]: the samples concatenated."""
    parts = [sample_tensors(s, w) for s, w in zip(samples, weights)]
    row = {k: torch.cat([p[k] for p in parts]).unsqueeze(0) for k in parts[0]}
    return MicroBatch(attention_mask=None, sample_lengths=tuple(len(s.input_ids) for s in samples), **row,
                      **images_of(samples))


def padded_micro_batch(samples: list[Sample], weights: list[float], pad_id: int) -> MicroBatch:
    """Right-pad samples to the longest one; padding has zero weight and no attention."""
    parts = [sample_tensors(s, w) for s, w in zip(samples, weights)]
    width = max(len(s.input_ids) for s in samples)
    pad_values = {"input_ids": pad_id, "position_ids": 0, "loss_mask": False, "routed_experts": -1}
    row = {
        k: torch.stack([_pad(p[k], width, pad_values.get(k, 0)) for p in parts]) for k in parts[0]
    }  # [B, T] each
    attention = torch.stack([_pad(torch.ones(len(s.input_ids), dtype=torch.long), width, 0) for s in samples])
    return MicroBatch(attention_mask=attention, **row, **images_of(samples))


def images_of(samples: list[Sample]) -> dict[str, torch.Tensor | None]:
    """The samples' images, in order, as one micro-batch holds them; None where none has any."""
    seen = [s for s in samples if s.pixel_values is not None]
    if not seen:
        return {"pixel_values": None, "image_grid_thw": None}
    return {"pixel_values": torch.cat([s.pixel_values for s in seen]),
            "image_grid_thw": torch.cat([s.image_grid_thw for s in seen])}


def _pad(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.cat([t, torch.full((width - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)])


def filler_token_id(tokenizer) -> int:
    """The token that pads rows and fills empty micro-batches: the pad token, else eos (Llama-3 and others have
    no pad token), else 0. It is masked wherever it is placed, so it never trains; it only has to be an id."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def empty_micro_batch(pad_id: int, packing: bool) -> MicroBatch:
    """A micro-batch with nothing to train on, for ranks with fewer micro-batches than their peers."""
    filler = Sample([pad_id, pad_id], [0, 0], [0.0, 0.0], 0.0, 0.0, 0)
    return packed_micro_batch([filler], [0.0]) if packing else padded_micro_batch([filler], [0.0], pad_id)


def build_micro_batches(
    samples: list[Sample], weights: list[float], row_tokens: int, micro_batch_size: int, packing: bool, pad_id: int
) -> list[MicroBatch]:
    """Samples must already be truncated to at most row_tokens (seq_len)."""
    if packing:
        rows = pack_rows([len(s.input_ids) for s in samples], row_tokens)
        return [packed_micro_batch([samples[i] for i in r], [weights[i] for i in r]) for r in rows]
    starts = range(0, len(samples), micro_batch_size)
    return [
        padded_micro_batch(samples[i : i + micro_batch_size], weights[i : i + micro_batch_size], pad_id) for i in starts
    ]
