"""The off-policy corrections and the GSPO / CISPO objectives against numbers worked out by hand, from the peers'
published definitions (arithmetic in the comments).

One packed row holds two samples of three tokens (positions restart at 0); token 0 of each has no prediction.
Ratios r = pi_theta / pi_old of the trained tokens:
    sample a (A = +1): t1 r = 1.5,  t2 r = 0.5    mean log r = (0.405465 - 0.693147) / 2 = -0.143841
                                                   geometric mean g = exp(-0.143841) = 0.866025, product 0.75
    sample b (A = -1): t1 r = 1.02, t2 r = 1.0    mean log r = 0.019803 / 2 = 0.0099013
                                                   g = 1.0099505, product 1.02
"""

import math

import pytest
import torch

from rl.trainer.corrections import HISTOGRAM_BINS, correct, log_ratio_histogram, ratio_quantile, sample_ids
from rl.trainer.loss import policy_loss
from rl.trainer.loss_config import (
    CISPOObjective, GeoMask, GSPOObjective, IcePopMask, LossConfig, OutlierMask, SequenceTruncate, TruncateRatio,
)

OLD = math.log(0.5)
RATIOS = [1.0, 1.5, 0.5, 1.0, 1.02, 1.0]
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2]])
MASK = torch.tensor([[False, True, True, False, True, True]])
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])


def log_ratios() -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in RATIOS]])


def corrected(*corrections):
    return correct(log_ratios(), MASK, POSITIONS, list(corrections))


def run(config: LossConfig, advantages: torch.Tensor = ADVANTAGES):
    logprobs = (torch.full((1, 6), OLD) + log_ratios()).requires_grad_()
    loss, stats = policy_loss(logprobs, torch.full((1, 6), OLD), advantages, MASK, torch.full((1, 6), 0.25), config,
                              position_ids=POSITIONS)
    loss.backward()
    return loss.item(), stats, logprobs.grad[0].tolist()


def test_samples_are_told_apart_by_their_positions():
    assert sample_ids(POSITIONS).tolist() == [[0, 0, 0, 1, 1, 1]]
    assert sample_ids(torch.tensor([[0, 1], [0, 0]])).tolist() == [[0, 0], [2, 3]]  # distinct across rows


def test_geometric_mask_drops_the_sample_whose_mean_ratio_leaves_the_bounds():
    fixed = corrected(GeoMask(low=0.99, high=1.01))  # a: 0.866 < 0.99; b: 1.00995 <= 1.01
    assert fixed.keep.tolist() == [[False, False, False, False, True, True]]
    assert (fixed.sequences.item(), fixed.masked_sequences.item()) == (2, 1)
    assert corrected(GeoMask(low=0.8, high=1.005)).keep.tolist() == [[False, True, True, False, False, False]]


def test_sequence_truncation_scales_a_sample_whose_ratio_exceeds_the_cap():
    fixed = corrected(SequenceTruncate(cap=1.01))  # a: 0.75 <= 1.01, scale 1; b: 1.02 > 1.01, scale 1.01 / 1.02
    assert fixed.scale[0, 1:3].tolist() == pytest.approx([1.0, 1.0])
    assert fixed.scale[0, 4:].tolist() == pytest.approx([0.990196] * 2, abs=1e-6)
    assert fixed.keep.tolist() == MASK.tolist()


def test_outlier_mask_drops_a_sample_with_any_token_beyond_the_bounds():
    fixed = corrected(OutlierMask(low=0.6, high=1.45))  # a's t1 r = 1.5 > 1.45 (and t2 0.5 < 0.6): all of a
    assert fixed.keep.tolist() == [[False, False, False, False, True, True]]


def test_icepop_masks_tokens_not_samples():
    fixed = corrected(IcePopMask(low=0.6, high=5.0))  # only a's t2 (r = 0.5)
    assert fixed.keep.tolist() == [[False, True, False, False, True, True]]
    assert fixed.masked_sequences.item() == 0


def test_a_stack_is_the_composition_in_any_order():
    geo, seq, cap = GeoMask(low=0.8, high=1.2), SequenceTruncate(cap=1.01), TruncateRatio(cap=1.4)
    one, two = corrected(geo, seq, cap), corrected(cap, seq, geo)
    for stacked in (one, two):
        assert stacked.keep.tolist() == (corrected(geo).keep & corrected(seq).keep).tolist()
        assert stacked.scale[0].tolist() == pytest.approx((corrected(geo).scale * corrected(seq).scale)[0].tolist())
        assert stacked.ratio_cap == 1.4
    assert corrected(TruncateRatio(cap=3.0), TruncateRatio(cap=1.4)).ratio_cap == 1.4  # the smallest cap


def test_the_loss_applies_the_stack():
    loss, stats, grad = run(LossConfig(mismatch=[GeoMask(low=0.99, high=1.01), SequenceTruncate(cap=1.01)]))
    # only b is kept, scaled by 0.990196: PPO's tokens -min(-1.02, -1.28)= 1.02 and -min(-1.0, -1.0) = 1.0
    assert loss == pytest.approx(0.990196 * (1.02 + 1.0) / 4, abs=1e-6)
    assert stats.masked_tokens.item() == 2 and stats.masked_samples.item() == 1
    assert grad[1:3] == [0.0, 0.0]


def test_gspo_clips_the_samples_geometric_ratio_and_each_token_keeps_its_gradient():
    loss, stats, grad = run(LossConfig(objective=GSPOObjective()))  # eps 3e-4 / 4e-4: clip to [0.9997, 1.0004]
    # a: s = 0.866025, A = +1: -min(0.866025, 0.9997) = -0.866025 (unclipped, it is smaller)
    # b: s = 1.0099505, A = -1: -min(-1.0099505, -1.0004) = 1.0099505 (unclipped)
    assert loss == pytest.approx((2 * -0.866025 + 2 * 1.0099505) / 4, abs=1e-6)
    # d/dlogp_t of -s A w, s = sg(s) * pi(t) / sg(pi(t)): -s A w at each trained token
    assert grad == pytest.approx([0, -0.866025 / 4, -0.866025 / 4, 0, 1.0099505 / 4, 1.0099505 / 4], abs=1e-6)
    assert stats.clipped_tokens.item() == 0
    loss, clipped, grad = run(LossConfig(objective=GSPOObjective(eps_low=0.1, eps_high=0.1)), -ADVANTAGES)
    # advantages flipped: a (A = -1, s = 0.866 < 0.9) is clipped: -min(-0.866, -0.9) = 0.9, no gradient;
    # b (A = +1, s = 1.0099505 within [0.9, 1.1]): -1.0099505
    assert clipped.clipped_tokens.item() == 2 and grad[1:3] == [0.0, 0.0]
    assert loss == pytest.approx((2 * 0.9 - 2 * 1.0099505) / 4, abs=1e-6)


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    _, stats, grad = run(LossConfig(objective=CISPOObjective(max_weight=1.4)))
    # L_t = -sg(min(r_t, 1.4)) A log pi(t): gradient -min(r_t, 1.4) A w; a's t1 weight is capped (1.5 -> 1.4)
    assert grad == pytest.approx([0, -1.4 / 4, -0.5 / 4, 0, 1.02 / 4, 1.0 / 4])
    assert stats.clipped_tokens.item() == 1


def test_ratio_quantiles_from_the_histogram():
    log_ratio = torch.tensor([[0.0] * 98 + [-0.5, 3.0]])
    histogram = log_ratio_histogram(log_ratio, torch.ones_like(log_ratio, dtype=torch.bool)).tolist()
    assert len(histogram) == HISTOGRAM_BINS + 2 and sum(histogram) == 100
    assert ratio_quantile(histogram, 0.5) == pytest.approx(1.0, abs=0.01)  # within a bin (width 0.01) of r = 1
    assert ratio_quantile(histogram, 0.01) == pytest.approx(math.exp(-0.5), rel=0.01)
    assert ratio_quantile(histogram, 1.0) == pytest.approx(math.exp(2.0))  # beyond the range: its edge
    assert ratio_quantile([0.0] * (HISTOGRAM_BINS + 2), 0.5) is None


def test_the_step_record_carries_the_quantiles_and_the_masked_samples():
    from rl.trainer.loss import StepTotals
    from rl.trainer.step import RATIO_BIN_KEYS, SUM_KEYS, summarise

    _, stats, _ = run(LossConfig(mismatch=[GeoMask(low=0.99, high=1.01)]))
    sums = dict.fromkeys(SUM_KEYS, 0.0) | {"samples": stats.samples.item(), "masked_samples": 1.0}
    sums |= dict(zip(RATIO_BIN_KEYS, stats.ratio_histogram.tolist()))
    record = summarise(sums, StepTotals(samples=2, tokens=4))
    assert record["masked_seq_frac"] == 0.5
    # the 4 ratios 0.5, 1.0, 1.02, 1.5: p1 in 0.5's bin, p50 in 1.0's, p99 in 1.5's (bins 0.01 wide in log r)
    assert [record[f"ratio_p{q}"] for q in (1, 50, 99)] == pytest.approx([0.5, 1.0, 1.5], rel=0.01)


def test_a_mask_against_rescored_reads_the_rescored_ratio_and_a_truncation_the_sampled_one():
    # the rescored ratios (pi_theta over inference's under the same weights): a 1.001 and 0.999 (mean log 0, g = 1),
    # b 1.2 and 1.2 (g = 1.2): against them the geometric mask keeps a and drops b, the reverse of against the
    # sampled ratios; seq_truncate (cap 1.01) still reads the sampled ones: b's product 1.02 is scaled by 1.01 / 1.02
    rescored = torch.tensor([[0.0, math.log(1.001), math.log(0.999), 0.0, math.log(1.2), math.log(1.2)]])
    fixed = correct(log_ratios(), MASK, POSITIONS, [GeoMask(against="rescored"), SequenceTruncate(cap=1.01)],
                    rescored)
    assert fixed.keep.tolist() == [[False, True, True, False, False, False]]
    assert fixed.scale[0, 4:6].tolist() == pytest.approx([1.01 / 1.02] * 2)
    assert corrected(GeoMask()).keep.tolist() == [[False, False, False, False, True, True]]  # against sampled
    with pytest.raises(ValueError, match="geo_mask against = 'rescored' needs inference's logprobs"):
        corrected(GeoMask(against="rescored"))
