"""The loss against numbers worked out by hand on tiny tensors (the arithmetic is in the comments)."""

import math

import pytest
import torch

from rl.trainer.loss_config import DapoNorm, DrGrpoNorm, GrpoNorm, LossConfig, MaskRatio, TruncateRatio
from rl.trainer.loss import StepTotals, policy_loss, sample_weight

# Two samples of three tokens; token 0 has no prediction. Ratios r = pi_theta / pi_old:
#   sample 0 (A = +1): t1 r = 1.5, t2 r = 0.5
#   sample 1 (A = -1): t1 r = 1.5, t2 r = 0.5
# eps_low = 0.2, eps_high = 0.28 so clip(r) is 1.28 for r = 1.5 and 0.8 for r = 0.5. Per-token loss
# L = -min(r A, clip(r) A):
#   s0 t1: -min(1.5, 1.28)   = -1.28 (clipped)     s0 t2: -min(0.5, 0.8)   = -0.5
#   s1 t1: -min(-1.5, -1.28) = 1.5                  s1 t2: -min(-0.5, -0.8) = 0.8 (clipped)
OLD = math.log(0.5)
LOGPROBS = [[OLD, math.log(0.75), math.log(0.25)], [OLD, math.log(0.75), math.log(0.25)]]
ADV = [[1.0] * 3, [-1.0] * 3]
FULL_MASK = [[False, True, True], [False, True, True]]


def run(config: LossConfig, weight: float | list, mask=FULL_MASK, ref=None):
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    old = torch.full((2, 3), OLD)
    weights = torch.tensor(weight) if isinstance(weight, list) else torch.full((2, 3), weight)
    ref_lp = None if ref is None else torch.tensor(ref)
    loss, stats = policy_loss(logprobs, old, torch.tensor(ADV), torch.tensor(mask), weights, config, ref_lp)
    loss.backward()
    return loss.item(), stats, logprobs.grad


def test_dapo_clipping_and_statistics():
    loss, stats, grad = run(LossConfig(), weight=1 / 4)
    assert loss == pytest.approx(0.13)  # (-1.28 - 0.5 + 1.5 + 0.8) / 4 = 0.52 / 4
    assert stats.clipped_tokens.item() == 2  # s0 t1 and s1 t2
    # r - 1 - log r: r = 1.5 -> 0.5 - 0.405465 = 0.094535; r = 0.5 -> -0.5 + 0.693147 = 0.193147; twice each
    assert stats.mismatch_kl_sum.item() == pytest.approx(0.575364, abs=1e-6)
    assert stats.masked_tokens.item() == 0 and stats.ref_kl_sum.item() == 0
    # d/dlogp of -w r A is -w r A on unclipped tokens, 0 on clipped ones and on untrained token 0
    expected = [[0.0, 0.0, -0.125], [0.0, 0.375, 0.0]]  # -0.5/4 ; +1.5/4
    assert grad.flatten().tolist() == pytest.approx([g for row in expected for g in row])


# Sample 1 trains only t1: n_0 = 2, n_1 = 1, S = 2 samples, N = 3 tokens; token losses -1.28, -0.5 | 1.5
SHORT_MASK = [[False, True, True], [False, True, False]]


def test_grpo_mean_per_sample_then_over_samples():
    weights = [[1 / 4] * 3, [1 / 2] * 3]  # 1 / (S n_i): 1/(2*2), 1/(2*1)
    loss, _, _ = run(LossConfig(norm=GrpoNorm()), weights, SHORT_MASK)
    assert loss == pytest.approx(0.305)  # ((-1.28 - 0.5) / 2 + 1.5 / 1) / 2 = (-0.89 + 1.5) / 2


def test_dapo_and_dr_grpo_on_uneven_samples():
    loss, _, _ = run(LossConfig(norm=DapoNorm()), 1 / 3, SHORT_MASK)
    assert loss == pytest.approx(-0.0933333, abs=1e-6)  # (-1.28 - 0.5 + 1.5) / 3 = -0.28 / 3
    loss, _, _ = run(LossConfig(norm=DrGrpoNorm(tokens_per_sample=4)), 1 / 8, SHORT_MASK)
    assert loss == pytest.approx(-0.035)  # -0.28 / (2 samples * 4)


def test_sample_weights():
    totals = StepTotals(samples=2, tokens=3)
    assert sample_weight(DapoNorm(), 2, totals, seq_len=8) == pytest.approx(1 / 3)  # 1 / N
    assert sample_weight(GrpoNorm(), 2, totals, seq_len=8) == pytest.approx(1 / 4)  # 1 / (2 * 2)
    assert sample_weight(DrGrpoNorm(), 2, totals, seq_len=8) == pytest.approx(1 / 16)  # 1 / (2 * seq_len 8)
    assert sample_weight(DrGrpoNorm(tokens_per_sample=5), 1, totals, seq_len=8) == pytest.approx(1 / 10)
    assert sample_weight(GrpoNorm(), 0, totals, seq_len=8) == 0.0  # nothing trained in that sample


def test_truncated_ratio_caps_negative_advantage_tokens():
    loss, _, grad = run(LossConfig(mismatch=TruncateRatio(cap=1.4)), weight=1 / 4)
    # s1 t1: r = 1.5 truncated to 1.4: -min(-1.4, -1.28) = 1.4; the rest unchanged
    assert loss == pytest.approx(0.105)  # (-1.28 - 0.5 + 1.4 + 0.8) / 4 = 0.42 / 4
    assert grad[1, 1].item() == 0.0  # the truncated token carries no gradient


def test_mismatch_mask_drops_tokens_beyond_the_bound():
    loss, stats, grad = run(LossConfig(mismatch=MaskRatio(max_log_ratio=0.6)), weight=1 / 4)
    # |log 1.5| = 0.405 is kept, |log 0.5| = 0.693 is dropped: (-1.28 + 1.5) / 4 (N unchanged)
    assert loss == pytest.approx(0.055)
    assert stats.masked_tokens.item() == 2
    assert grad[0, 2].item() == 0.0


def test_kl_penalty_k3_to_reference():
    # reference is twice as likely as pi_theta on s0 t1 (q = log 2), equal elsewhere (q = 0, k3 = 0):
    # k3 = e^q - q - 1 = 2 - 0.693147 - 1 = 0.306853
    ref = [list(row) for row in LOGPROBS]
    ref[0][1] = math.log(1.5)
    loss, stats, _ = run(LossConfig(beta=0.1), weight=1 / 4, ref=ref)
    assert stats.ref_kl_sum.item() == pytest.approx(0.306853, abs=1e-6)
    assert loss == pytest.approx(0.137671, abs=1e-6)  # (0.52 + 0.1 * 0.306853) / 4


# On-policy distillation: the teacher's logprobs log pi_T per token. With the reward advantage off (reward_weight 0)
# and lambda = 1, A_t = log pi_T(t) - log pi_old(t), pi_old = 0.5 everywhere:
#   s0: pi_T = 0.5 at t1 (A_t = 0), pi_T = 1.0 at t2 (A_t = log 2 = 0.693147)
#   s1: pi_T = 0.25 at t1 (A_t = -log 2), pi_T = 0.5 at t2 (A_t = 0)
TEACHER = [[OLD, math.log(0.5), 0.0], [OLD, math.log(0.25), math.log(0.5)]]


def test_distillation_alone_moves_the_student_toward_the_teacher():
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    old, teacher = torch.full((2, 3), OLD), torch.tensor(TEACHER)
    config = LossConfig(distill=1.0, reward_weight=0.0)
    loss, stats = policy_loss(logprobs, old, torch.tensor(ADV), torch.tensor(FULL_MASK), torch.full((2, 3), 0.25),
                              config, teacher_logprobs=teacher)
    loss.backward()
    log2 = math.log(2)
    # L_t = -min(r A_t, clip(r) A_t): s0 t2 r = 0.5, A = log 2 -> -0.5 log 2 (unclipped: 0.5 < 0.8);
    # s1 t1 r = 1.5, A = -log 2 -> -min(-1.5 log 2, -1.28 log 2) = 1.5 log 2; the rest 0. Mean over 4 tokens.
    assert loss.item() == pytest.approx((-0.5 * log2 + 1.5 * log2) / 4)
    # reverse KL estimate log pi_old - log pi_T: 0 + (-log 2) + log 2 + 0 = 0 over the four trained tokens
    assert stats.reverse_kl_sum.item() == pytest.approx(0.0, abs=1e-6)
    # gradient -w r A_t on unclipped tokens: s0 t2 -0.25 * 0.5 * log 2 (push its logprob up, toward the teacher);
    # s1 t1 +0.25 * 1.5 * log 2 (down, toward the teacher)
    assert logprobs.grad.flatten().tolist() == pytest.approx([0, 0, -0.125 * log2, 0, 0.375 * log2, 0], abs=1e-7)


def test_distillation_with_a_baseline_moves_each_token_by_its_reverse_kl_against_the_steps_mean():
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    old, teacher = torch.full((2, 3), OLD), torch.tensor(TEACHER)
    config = LossConfig(distill=1.0, reward_weight=0.0)
    loss, _ = policy_loss(logprobs, old, torch.tensor(ADV), torch.tensor(FULL_MASK), torch.full((2, 3), 0.25),
                          config, teacher_logprobs=teacher, distill_baseline=0.5)
    loss.backward()
    log2 = math.log(2)
    # A_t = 0.5 - k_t: s0 t1 0.5 (r 1.5, clipped: -1.28 * 0.5), s0 t2 0.5 + log 2 (r 0.5: -0.5 A),
    # s1 t1 0.5 - log 2 < 0 (r 1.5: -1.5 A), s1 t2 0.5 (r 0.5: -0.5 A)
    expected = (-0.64 - 0.5 * (0.5 + log2) + 1.5 * (log2 - 0.5) - 0.25) / 4
    assert loss.item() == pytest.approx(expected)
    # the clipped token has no gradient; the others -w r A_t
    grads = [0, 0, -0.25 * 0.5 * (0.5 + log2), 0, -0.25 * 1.5 * (0.5 - log2), -0.25 * 0.5 * 0.5]
    assert logprobs.grad.flatten().tolist() == pytest.approx(grads, abs=1e-7)


def test_the_distillation_baseline_is_the_steps_mean_reverse_kl_over_trained_tokens_of_every_rank():
    from rl.samples import Sample
    from rl.trainer.data import build_micro_batches
    from rl.trainer.loss import StepTotals
    from rl.trainer.step import distill_baseline

    # trained tokens: a's 2nd and 3rd (k = 0.5, 1.5), b's 3rd (k = -1.0); prompt tokens and the first count for nothing
    a = Sample([1, 2, 3], [1, 1, 1], [-9.0, -1.0, -2.0], 0.0, 0.0, 0, [0.0, -1.5, -3.5])
    b = Sample([1, 2, 3], [0, 0, 1], [0.0, 0.0, -2.0], 0.0, 0.0, 0, [5.0, 5.0, -1.0])
    other_rank = [3.0]  # another rank's sum over its one trained token
    world = type("World", (), {"all_reduce": lambda self, values: [v + o for v, o in zip(values, other_rank)]})()
    batches = build_micro_batches([a, b], [1.0, 1.0], 8, 1, False, 0)  # one sample a micro-batch
    totals = StepTotals(samples=3, tokens=4)  # every rank's trained tokens
    assert distill_baseline(batches, totals, world) == pytest.approx((0.5 + 1.5 - 1.0 + 3.0) / 4)


def test_distillation_beside_the_reward_adds_to_each_tokens_advantage():
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    old, teacher = torch.full((2, 3), OLD), torch.tensor(TEACHER)
    config = LossConfig(distill=0.5)
    loss, stats = policy_loss(logprobs, old, torch.tensor(ADV), torch.tensor(FULL_MASK), torch.full((2, 3), 0.25),
                              config, teacher_logprobs=teacher)
    half = 0.5 * math.log(2)
    # A_t: s0 t1 1, s0 t2 1 + half; s1 t1 -1 - half, s1 t2 -1
    # s0 t1 r 1.5: -min(1.5, 1.28) = -1.28; s0 t2 r 0.5: -0.5 (1 + half); s1 t1 r 1.5: 1.5 (1 + half);
    # s1 t2 r 0.5: -min(-0.5, -0.8) = 0.8
    expected = (-1.28 - 0.5 * (1 + half) + 1.5 * (1 + half) + 0.8) / 4
    assert loss.item() == pytest.approx(expected)
    # without a teacher the term is 0: the same loss as the reward alone
    loss_plain, _ = policy_loss(logprobs.detach(), old, torch.tensor(ADV), torch.tensor(FULL_MASK),
                                torch.full((2, 3), 0.25), config, teacher_logprobs=old)
    assert loss_plain.item() == pytest.approx(0.13)


def test_the_top_k_term_is_the_reverse_kl_over_the_teachers_top_k_and_the_rest():
    from rl.trainer.output_head import TeacherTopK, chunked_scores

    # one position, vocabulary of 4, the student uniform (logits 0); the teacher's top 2 are tokens 1 and 3 at 0.4
    # each, the rest 0.2. The student: 0.25 each, the rest 0.5.
    hidden, weight = torch.zeros(1, 1, 2, requires_grad=True), torch.zeros(4, 2)
    teacher = TeacherTopK(torch.tensor([[[1, 3]]]), torch.tensor([[[math.log(0.4), math.log(0.4)]]]))
    _, _, kl = chunked_scores(hidden, weight, torch.tensor([[1]]), 1.0, 8, teacher)
    expected = 2 * 0.25 * math.log(0.25 / 0.4) + 0.5 * math.log(0.5 / 0.2)
    assert kl.item() == pytest.approx(expected)
    # with reward and the sampled-token term off, L = mu * w * D
    config = LossConfig(reward_weight=0.0, distill_top_k=2.0)
    zeros, mask = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    loss, stats = policy_loss(zeros.requires_grad_(), zeros, zeros, mask, torch.full((1, 1), 0.5), config,
                              top_k_kl=kl)
    assert loss.item() == pytest.approx(2.0 * 0.5 * expected)
    assert stats.top_k_kl_sum.item() == pytest.approx(expected)
    # masked, it counts for nothing
    loss, stats = policy_loss(zeros, zeros, zeros, ~mask, torch.full((1, 1), 0.5), config, top_k_kl=kl)
    assert loss.item() == 0 and stats.top_k_kl_sum.item() == 0


def test_the_top_k_term_alone_moves_the_students_distribution_onto_the_teachers():
    from rl.trainer.output_head import TeacherTopK, chunked_scores

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 6, 8, generator=g)
    weight = torch.randn(12, 8, generator=g, requires_grad=True)
    teacher = torch.log_softmax(3 * torch.randn(6, 12, generator=g), -1)  # a peaked teacher over all 12 tokens
    top_logprobs, top_ids = teacher.topk(11, -1)  # all but one token: with the rest, the full reverse KL
    config = LossConfig(reward_weight=0.0, distill_top_k=1.0)
    zeros, mask = torch.zeros(1, 6), torch.ones(1, 6, dtype=torch.bool)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    kls = []
    for _ in range(30):
        logprobs, _, kl = chunked_scores(hidden, weight, torch.zeros(1, 6, dtype=torch.long), 1.0, 4,
                                         TeacherTopK(top_ids[None], top_logprobs[None]))
        loss, stats = policy_loss(logprobs, zeros, zeros, mask, torch.full((1, 6), 1 / 6), config, top_k_kl=kl)
        student = torch.log_softmax(hidden[0] @ weight.detach().T, -1)
        kls.append((student.exp() * (student - teacher)).sum(-1).mean().item())
        assert stats.top_k_kl_sum.item() / 6 == pytest.approx(kls[-1], rel=1e-4)  # reported = the true KL here
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert kls[-1] < 0.5 * kls[0], kls  # toward the teacher, step after step
    assert all(b < a for a, b in zip(kls, kls[1:]))


def test_the_logprob_correlation_from_summed_moments_equals_pearsons_over_all_tokens():
    """Moments summed over micro-batches (and ranks) give the correlation over every trained token at once; a side
    without spread gives none."""
    from rl.trainer.loss import MOMENT_KEYS, logprob_moments, moments_correlation

    torch.manual_seed(0)
    x, noise = -torch.rand(2, 16) * 3, torch.randn(2, 16) * 0.3
    y, mask = x + noise, torch.rand(2, 16) > 0.3
    sums = sum(logprob_moments(x[i:i + 1], y[i:i + 1], mask[i:i + 1]) for i in range(2))
    expected = torch.corrcoef(torch.stack([x[mask], y[mask]]).double())[0, 1].item()
    assert abs(moments_correlation(dict(zip(MOMENT_KEYS, sums.tolist()))) - expected) < 1e-9
    constant = logprob_moments(torch.full((1, 4), -1.0), -torch.rand(1, 4), torch.ones(1, 4, dtype=torch.bool))
    assert moments_correlation(dict(zip(MOMENT_KEYS, constant.tolist()))) is None
