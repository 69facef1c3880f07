"""Full batches (rl/orchestrator/fill.py): rounds of extra groups until the step's groups are trainable, bounded."""

import asyncio

from rl.orchestrator.fill import fill_batch


def scripted(*rounds: list[bool]):
    """`run_more` that appends the next round's groups (True: trainable) and records what it was asked for."""
    asked, pending = [], list(rounds)

    async def run_more(count: int, outcomes: list[bool]) -> list[bool]:
        asked.append(count)
        return outcomes + pending.pop(0)[:count]

    return run_more, asked


def fill(outcomes, wanted, max_extra, run_more):
    return asyncio.run(fill_batch(outcomes, wanted, max_extra, bool, run_more))


def test_a_full_step_draws_nothing():
    run_more, asked = scripted()
    filled = fill([True] * 4, 4, 8, run_more)
    assert (filled.extra_groups, filled.rounds, filled.short, asked) == (0, 0, 0, [])


def test_a_round_draws_what_is_missing_over_the_share_kept_so_far():
    run_more, asked = scripted([True, False, True, False, True, False])
    filled = fill([True, False, False, False], 4, 16, run_more)  # 3 missing, 1 in 4 kept: 12 drawn
    assert asked == [12] and filled.extra_groups == 12 and filled.short == 0
    assert sum(filled.outcomes) == 4


def test_rounds_go_on_until_the_step_is_full():
    run_more, asked = scripted([False, True], [True, True, True])
    filled = fill([True, True, False, False], 4, 16, run_more)  # 2 missing at 1/2 kept: 4; then 1 at 3/6: 2
    assert asked == [4, 2] and filled.rounds == 2 and filled.short == 0 and filled.drawn == [4, 2]


def test_the_bound_stops_the_rounds_and_the_step_is_short():
    run_more, asked = scripted([False] * 40, [False] * 40)
    filled = fill([False] * 4, 4, 5, run_more)  # nothing kept: 10x what is missing, cut to the bound
    assert asked == [5] and filled.extra_groups == 5 and filled.short == 4


def test_every_round_stays_within_the_bound():
    run_more, asked = scripted(*[[False, False, True]] * 10)
    filled = fill([False, False, True], 3, 7, run_more)
    assert sum(asked) == filled.extra_groups <= 7 and filled.short == 3 - sum(filled.outcomes)
