"""Turn a rank's samples into padded micro-batches the model can consume."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.protocol import Sample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] 1 for real tokens
    loss_mask: torch.Tensor  # [B, T] bool, predicted tokens that are trained on
    old_logprobs: torch.Tensor  # [B, T] inference logprob of token t, aligned with loss_mask
    advantages: torch.Tensor  # [B]

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(*(t.to(device) for t in vars(self).values()))


def pad_micro_batch(samples: list[Sample], seq_len: int, pad_id: int) -> MicroBatch:
    """Right-pad samples to the longest one (at most seq_len tokens each, longer ones truncated)."""
    width = min(max(len(s.input_ids) for s in samples), seq_len)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.bool)
    old_lp = torch.zeros((batch, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = min(len(s.input_ids), width)
        input_ids[i, :n] = torch.tensor(s.input_ids[:n])
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(s.loss_mask[:n], dtype=torch.bool)
        old_lp[i, :n] = torch.tensor(s.logprobs[:n])
    loss_mask[:, 0] = False  # the first token has no prediction
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return MicroBatch(input_ids, attention, loss_mask, old_lp, advantages)


def micro_batches(samples: list[Sample], size: int, seq_len: int, pad_id: int, count: int) -> list[MicroBatch | None]:
    """Split into `count` micro-batches of at most `size` samples; None pads a short rank so that every
    rank runs the same number of forward/backward passes (FSDP collectives must match)."""
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    assert len(chunks) <= count, "count must cover every chunk"
    return [pad_micro_batch(c, seq_len, pad_id) for c in chunks] + [None] * (count - len(chunks))
