"""Assemble one trainer step's batch: samples from groups, balanced across trainer ranks by tokens."""

from __future__ import annotations

from rl.protocol import Sample


def balance_by_tokens(samples: list[Sample], ranks: int) -> list[list[Sample]]:
    """Equal sample counts per rank; longest samples first to the rank with the fewest tokens so far."""
    if len(samples) % ranks:
        raise ValueError(f"{len(samples)} samples cannot be split evenly over {ranks} trainer ranks")
    per_rank = len(samples) // ranks
    buckets: list[list[Sample]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        open_ranks = [r for r in range(ranks) if len(buckets[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: tokens[r])
        buckets[rank].append(sample)
        tokens[rank] += len(sample.input_ids)
    return buckets
