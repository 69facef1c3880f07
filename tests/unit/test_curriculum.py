"""The difficulty curriculum (`sampler.type = "difficulty"`, rl/orchestrator/sampler.py): pools by each task's latest
group mean, draws by pool weight, and a state that makes a resumed run draw as an unbroken one."""

import random

import pytest

from rl.envs.config import DifficultySampling, EpochSampling
from rl.orchestrator.sampler import DifficultyPools, TaskSampler
from rl.orchestrator.state import load_state, restore_samplers, save_state
from rl.protocol import RunPaths


def test_tasks_move_between_pools_by_their_latest_group_mean():
    pools = DifficultyPools(6, seed=0, config=DifficultySampling(easy=0.8, hard=0.2))
    assert pools.sizes() == {"easy": 0, "medium": 6, "hard": 0}  # unseen: medium
    for task, mean in ((0, 0.9), (1, 0.1), (2, 0.5), (3, 0.2), (4, 0.8)):
        pools.observe(task, mean)
    assert pools.pools == {"easy": [0, 4], "medium": [2, 5], "hard": [1, 3]}
    pools.observe(0, 0.0)  # the latest group counts
    assert pools.pools == {"easy": [4], "medium": [2, 5], "hard": [0, 1, 3]}


def test_draws_follow_the_pool_weights_and_an_empty_pools_share_goes_to_the_others():
    pools = DifficultyPools(100, seed=1, config=DifficultySampling(weights=(0.0, 0.25, 0.75)))
    for task in range(50):
        pools.observe(task, 0.0)  # 0..49 hard, 50..99 medium, none easy
    drawn = pools.draw(4000)
    hard = sum(task < 50 for task in drawn) / len(drawn)
    assert 0.72 < hard < 0.78
    assert len(set(drawn)) == 100  # within a pool, every task
    only_easy = DifficultyPools(10, seed=1, config=DifficultySampling(weights=(1.0, 0.0, 0.0)))
    assert set(only_easy.draw(20)) <= set(range(10))  # no easy task yet: the held pools are drawn alike


def play(sampler, steps: int, rewards: random.Random) -> list[list[int]]:
    """Steps of 4 draws, each task then observed with a made-up group mean."""
    drawn = []
    for _ in range(steps):
        tasks = sampler.draw(4)
        for task in tasks:
            sampler.observe(task, round(rewards.random(), 2))
        drawn.append(tasks)
    return drawn


def test_a_resumed_curriculum_draws_as_an_unbroken_one(tmp_path):
    config = DifficultySampling(weights=(0.2, 0.3, 0.5))
    straight = play(DifficultyPools(30, 7, config), 10, random.Random(0))
    paths, rewards = RunPaths(tmp_path), random.Random(0)
    first = DifficultyPools(30, 7, config)
    before = play(first, 6, rewards)
    save_state(paths, 6, 5, [first, TaskSampler(5, 1)], keep=1)
    resumed, epoch = restore_samplers(load_state(paths, 6), [DifficultyPools(30, 7, config), TaskSampler(5, 1)],
                                      [config, EpochSampling()])
    assert first.sizes() != {"easy": 0, "medium": 30, "hard": 0}  # the rewards moved tasks out of medium
    assert resumed.sizes() == first.sizes() and resumed.means == first.means and resumed.draws == 24
    assert before + play(resumed, 4, rewards) == straight


def test_a_resume_with_another_sampler_type_is_refused(tmp_path):
    paths = RunPaths(tmp_path)
    save_state(paths, 1, 0, [DifficultyPools(5, 0, DifficultySampling())], keep=1)
    with pytest.raises(ValueError, match="the saved sampler is of type 'difficulty', the config's 'epoch'"):
        restore_samplers(load_state(paths, 1), [TaskSampler(5, 0)], [EpochSampling()])


def test_pools_that_are_not_ordered_are_refused():
    with pytest.raises(ValueError, match=r"sampler.hard \(0.9\) must be below sampler.easy \(0.5\)"):
        DifficultySampling(easy=0.5, hard=0.9)
