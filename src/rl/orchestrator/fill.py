"""Full batches (DAPO's dynamic sampling, `advantage.fill_batch`): a step whose groups were dropped (all rewards equal
under `drop_zero_variance`, or failed) draws more groups until it has the batch's worth of trainable ones.

Each round draws what is still missing, scaled up by the share of the step's groups that were trainable so far (at
least MIN_KEEP_RATE), so that a step where most groups are all-correct needs few rounds, each a wave of generation.
The extra groups of a step are bounded (`advantage.max_extra_groups`); when the bound is spent the step trains on
the trainable groups it has and says how many it is short. A round that draws more trainable groups than are
missing leaves the last ones out of the batch (dropped as `batch_full`, in draw order, so a resumed run does the
same)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

MIN_KEEP_RATE = 0.1  # a step whose every group was dropped so far draws at most 10x what it misses per round

Outcome = TypeVar("Outcome")


@dataclass
class Filled(Generic[Outcome]):
    outcomes: list[Outcome]
    short: int = 0  # trainable groups still missing when the bound was spent
    drawn: list[int] = field(default_factory=list)  # extra groups drawn, per round

    @property
    def extra_groups(self) -> int:
        return sum(self.drawn)

    @property
    def rounds(self) -> int:
        return len(self.drawn)


async def fill_batch(
    outcomes: list[Outcome],
    wanted: int,
    max_extra: int,
    trainable: Callable[[Outcome], bool],
    run_more: Callable[[int, list[Outcome]], Awaitable[list[Outcome]]],
) -> Filled[Outcome]:
    """Draw rounds of groups until `wanted` of the outcomes are trainable or `max_extra` extra groups were drawn.

    `run_more(count, outcomes)` runs `count` new groups after `outcomes` and returns every outcome (the new ones
    last; it may remake earlier ones)."""
    filled = Filled(list(outcomes))
    while (missing := wanted - (kept := sum(map(trainable, filled.outcomes)))) > 0 and filled.extra_groups < max_extra:
        share = kept / max(len(filled.outcomes), 1)
        count = min(max_extra - filled.extra_groups, math.ceil(missing / max(share, MIN_KEEP_RATE)))
        filled.outcomes = await run_more(count, filled.outcomes)
        filled.drawn.append(count)
    filled.short = max(0, missing)
    return filled
