import pytest

from rl.orchestrator.advantage import compute_advantages, group_advantages
from rl.orchestrator.config import DrGrpoAdvantage, GrpoAdvantage, OrchestratorConfig, RlooAdvantage


def test_grpo_by_hand():
    # mean = (3 + 1 + 2) / 3 = 2; pstdev = sqrt((1 + 1 + 0) / 3) = 0.81650
    # A = (1, -1, 0) / 0.81650 = (1.22474, -1.22474, 0)
    assert compute_advantages("grpo", [3.0, 1.0, 2.0]) == pytest.approx([1.22474, -1.22474, 0.0], abs=1e-4)


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
