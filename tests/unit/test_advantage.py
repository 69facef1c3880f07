import pytest

from rl.orchestrator.advantage import admitted, compute_advantages, group_advantages, grpo_advantages
from rl.orchestrator.config import DrGrpoAdvantage, GrpoAdvantage, OrchestratorConfig, RlooAdvantage


def test_grpo_by_hand():
    # mean = (3 + 1 + 2) / 3 = 2; pstdev = sqrt((1 + 1 + 0) / 3) = 0.81650
    # A = (1, -1, 0) / 0.81650 = (1.22474, -1.22474, 0)
    assert compute_advantages("grpo", [3.0, 1.0, 2.0]) == pytest.approx([1.22474, -1.22474, 0.0], abs=1e-4)


def test_grpo_advantages_of_a_group_by_hand():
    # mean 0.5, population std 0.5; equal rewards: no signal
    assert grpo_advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert grpo_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_dr_grpo_by_hand():
    # mean = 1 / 4 = 0.25; A = r - 0.25
    assert compute_advantages("dr_grpo", [1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_by_hand():
    # A_1 = 2 - (4 + 6) / 2 = -3;  A_2 = 4 - (2 + 6) / 2 = 0;  A_3 = 6 - (2 + 4) / 2 = 3
    assert compute_advantages("rloo", [2.0, 4.0, 6.0]) == pytest.approx([-3.0, 0.0, 3.0])
    # A_1 = 1 - 0 / 3 = 1;  A_others = 0 - 1 / 3 = -0.33333  (= 4/3 * dr_grpo's 0.75 and -0.25)
    assert compute_advantages("rloo", [1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_zero_advantage(kind):
    assert compute_advantages(kind, [0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="ppo"):
        compute_advantages("ppo", [1.0, 0.0])


def test_drop_zero_variance_groups():
    assert group_advantages(GrpoAdvantage(drop_zero_variance=True), [0.5, 0.5], [False, False]) is None
    kept = group_advantages(GrpoAdvantage(), [0.5, 0.5], [False, False])
    assert kept == ([0.0, 0.0], [True, True])


def test_truncated_zero_and_mask():
    rewards, truncated = [1.0, 0.0, 0.0, 0.0], [True, False, False, False]
    # statistics include the truncated rollout: mean 0.25, so the others keep -0.25; its own becomes 0
    advantages, trainable = group_advantages(DrGrpoAdvantage(truncated="zero"), rewards, truncated)
    assert advantages == pytest.approx([0.0, -0.25, -0.25, -0.25]) and trainable == [True] * 4
    # mask: advantages as computed (leave-one-out: 1, -1/3 ...), the truncated rollout is not trained on
    advantages, trainable = group_advantages(RlooAdvantage(truncated="mask"), rewards, truncated)
    assert advantages == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert trainable == [False, True, True, True]


def test_advantage_config_is_a_discriminated_union():
    config = OrchestratorConfig(advantage={"type": "rloo", "truncated": "mask"})
    assert isinstance(config.advantage, RlooAdvantage)
    with pytest.raises(ValueError, match="type"):
        OrchestratorConfig(advantage={"type": "ppo"})
    with pytest.raises(ValueError, match="truncated"):
        OrchestratorConfig(advantage={"type": "grpo", "truncated": "drop"})


def test_the_advantage_gate_admits_a_range_of_absolute_advantages():
    gated = GrpoAdvantage(gate=(0.5, 1.5))
    assert [admitted(gated, a) for a in (-2.0, -1.0, -0.4, 0.0, 0.5, 1.5, 1.6)] == [
        False, True, False, False, True, True, False]
    assert all(admitted(GrpoAdvantage(), a) for a in (-100.0, 0.0, 3.0))


def test_a_gate_that_is_not_a_range_is_refused():
    with pytest.raises(ValueError, match=r"advantage.gate \[1.0, 0.5\] must be \[low, high\]"):
        GrpoAdvantage(gate=(1.0, 0.5))


def test_the_gate_leaves_the_rollouts_outside_it_out_of_the_batch():
    """The orchestrator's group_samples with a gate: rewards 0, 0, 1, 1 give |A| = 1 each (admitted by [0.5, 1.5]);
    0, 1, 1, 1 give |A| = 1.73 for the 0 (dropped) and 0.58 for the others."""
    from rl.orchestrator.batch import StepBatch, group_samples
    from rl.envs.rollouts import GroupOutcome, RolloutResult, TokenSegment

    config = OrchestratorConfig(advantage={"gate": [0.5, 1.5]}, rollouts_per_example=4)

    def group(rewards):
        segment = TokenSegment([1, 2], [3], [1], [-0.5])
        results = [RolloutResult(0, "t", [segment], r, {}, {}, False, 1) for r in rewards]
        return GroupOutcome(env=type("Env", (), {"name": "e"})(), results=results)

    batch = StepBatch([])
    assert [s.reward for s in group_samples(config, group([0.0, 0.0, 1.0, 1.0]), batch)] == [0, 0, 1, 1]
    assert [s.reward for s in group_samples(config, group([0.0, 1.0, 1.0, 1.0]), batch)] == [1, 1, 1]
    assert batch.dropped == {"advantage_gate": 1} and batch.dropped_by_env == {"e": 1}


def test_a_rollout_that_outlived_the_bound_is_withheld_alone_and_stays_in_its_groups_baseline():
    """Rewards 0, 1, 1, 0 (mean 0.5, std 0.5): advantages -1, 1, 1, -1. The last rollout's first token was sampled
    by policy 2, the others' by policy 6; at oldest_allowed 4 it is withheld, and the others keep the advantages the
    whole group gave them (without it the mean would be 2/3)."""
    from rl.envs.rollouts import GroupOutcome, RolloutResult, TokenSegment
    from rl.orchestrator.batch import StepBatch, build_batch, length_bias_stats

    def rollout(reward, first_version, turns=1):
        segment = TokenSegment([1, 2], [3, 4, 5], [1, 1, 1], [-0.5] * 3, [first_version, 6, 6])
        return RolloutResult(0, "t", [segment], reward, {}, {}, False, turns)

    results = [rollout(0.0, 6), rollout(1.0, 6), rollout(1.0, 6), rollout(0.0, 2, turns=3)]
    outcome = GroupOutcome(env=type("Env", (), {"name": "e"})(), results=results)
    outcome.policy_step = 6
    config = OrchestratorConfig(rollouts_per_example=4)
    batch = build_batch(config, [outcome], [6], 1, oldest_allowed=4)
    assert [s.advantage for s in batch.samples] == pytest.approx([-1.0, 1.0, 1.0], rel=1e-5)  # std's epsilon
    assert batch.withheld == 1 and +batch.dropped == {"older_than_max_off_policy_steps": 1}
    stats = length_bias_stats(batch)
    assert stats["off_policy/withheld"] == 1 and stats["off_policy/discarded_tokens"] == pytest.approx(0.25)
    assert (stats["off_policy/trained_len"], stats["off_policy/trained_turns"]) == (3, 1)
    everything = build_batch(config, [outcome], [6], 1, oldest_allowed=None)  # step by step: nothing is withheld
    assert len(everything.samples) == 4 and length_bias_stats(everything)["off_policy/discarded_tokens"] == 0
    assert isinstance(everything, StepBatch)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e200])
def test_a_reward_that_is_not_a_finite_float32_fails_its_rollout_not_the_run(bad, monkeypatch):
    """A reward function that divides by zero (or a judge answering NaN, or 1e200, beyond the batch's float32): that
    rollout is left out, named in the log and counted; its group trains on the others; a group with none left fails
    as a group does, by name."""
    import asyncio

    from rl.envs import rollouts
    from rl.envs.rollouts import RolloutResult, TokenSegment
    from rl.orchestrator.batch import build_batch

    def result(reward, component=1.0):
        return RolloutResult(7, "t", [TokenSegment([1], [2], [1], [-0.5])], reward, {"correct": component}, {},
                             False, 1)

    groups = iter([[result(0.0), result(1.0), result(bad), result(1.0, component=bad)], [result(bad)] * 2])

    async def fake_run_group(*args):
        return next(groups)

    monkeypatch.setattr(rollouts, "run_group", fake_run_group)
    env, log = type("Env", (), {"name": "e"})(), []
    outcome = asyncio.run(rollouts.run_group_retried(env, 7, 4, None, None, None, None, 1, log.append))
    assert [r.reward for r in outcome.results] == [0.0, 1.0] and outcome.unscored == 2
    assert "2 of 4 rollouts of task 7 of e have a reward that is not a finite float32" in log[0]
    assert f"reward={bad!r}" in log[0] and f"correct={bad!r}" in log[0]
    batch = build_batch(OrchestratorConfig(rollouts_per_example=4), [outcome], [0], 1)
    assert len(batch.samples) == 2 and batch.dropped["reward_not_finite"] == 2
    failed = asyncio.run(rollouts.run_group_retried(env, 8, 2, None, None, None, None, 1, log.append))
    assert failed.results is None and failed.error == "RewardNotFinite" and "task 8 of e" in failed.message
