"""The policy loss: clipped importance ratios (PPO, or GSPO's sequence ratios, or CISPO's clipped weights), with
normalisation variants, an optional KL penalty to a reference model, on-policy distillation and the off-policy and
mismatch corrections of trainer/corrections.py.

For every trained token t of sample i, with advantage A_i, trainer logprob log pi_theta(t), the inference
logprob log pi_old(t) recorded by the orchestrator, (beta > 0) the reference logprob log pi_ref(t) and
(distill > 0) the teacher's logprob log pi_T(t), scored by the orchestrator:

    A_t     = w_r * A_i - lambda * (k_t - b)         (w_r = reward_weight, lambda = distill)
    k_t     = log pi_old(t) - log pi_T(t)             per-token reverse KL to the teacher, b its step mean
    r_t     = exp(log pi_theta(t) - log pi_old(t))                          importance ratio
    r~_t    = min(r_t, C)             (a `truncate` correction, cap C)      else r~_t = r_t
    L_t     = -min(r~_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)  (objective ppo)
              + beta * (exp(q_t) - q_t - 1),  q_t = log pi_ref(t) - log pi_theta(t)   (k3 estimator)

GSPO (objective gspo, its own eps) puts the sample's ratio s_i = exp(mean_{u in T_i} log r_u) in place of r_t, as
s_i * pi_theta(t) / sg(pi_theta(t)): equal in value, with each token's own gradient. CISPO (objective cispo) clips
the weight and keeps every token's gradient: L_t = -sg(min(r_t, max_weight, C)) * A_t * log pi_theta(t).

The distillation term is on-policy distillation's: k_t = log pi_old(t) - log pi_T(t) is a one-sample estimate of the
reverse KL(pi || pi_T) at token t, so a token the teacher finds likelier than the student did gets a positive
advantage; its gradient through the ratio, clipping and masks is that of every token's. b is the step's mean k_t
over every trained token of all ranks (`distill_baseline`; else 0): a baseline, as Thinking Machines' recipe centres
its per-token KL advantages. On the student's own samples E[grad log pi] = 0, so subtracting it leaves the expected
gradient as it is and removes the part common to every token, which otherwise dominates a clipped gradient's
direction. A sample without teacher logprobs has log pi_T = log pi_old (data.py): no distillation term.
(distill_top_k > 0) with the teacher's k likeliest tokens S_t at t and its logprobs of them
(orchestrator.teacher.top_k), a dense term: the reverse KL from the student to the teacher over k + 1 outcomes, the
k tokens and all others as one ("rest": 1 minus the k's probability, for each model; trainer/output_head.py):

    D_t     = sum_{j in S_t} pi_theta(j) (log pi_theta(j) - log pi_T(j)) + pi_rest (log pi_rest - log pi_T,rest)
    L_t    += mu * D_t                                                          (mu = distill_top_k)

The sampled-token term estimates the same reverse KL from one token per position; D_t is exact over the k + 1
outcomes, so its gradient carries no sampling noise. Reverse, as that term: mode-seeking, it moves the student onto
the teacher's likely tokens and never asks it to spread over the teacher's doubts (a forward KL over the top k,
tried first, raised the student's entropy on its own samples and lost the reward: benchmarks/RESULTS.md). It is
an exact divergence, not a policy gradient: no ratio or clipping, only the masks and weights below.
    L       = sum_i sum_t m_t * s_t * w_i * L_t

m_t (0 or 1) and s_t (<= 1) are the corrections' masks and sequence truncations (trainer/corrections.py; 1 without
any).

The per-sample weight w_i sets the normalisation (S samples and N trained tokens in the whole step, all
ranks and micro-batches; n_i trained tokens of sample i):

    dapo     w_i = 1 / N                 token mean over the step
    grpo     w_i = 1 / (S * n_i)         token mean per sample, then mean over samples
    dr_grpo  w_i = 1 / (S * C_tok)       constant denominator (C_tok = tokens_per_sample, default seq_len)

Because every w_i uses step totals, micro-batches and ranks add up to the loss of the full batch.
Reported statistics are token sums; divided by N they give the step means:

    clip fraction   tokens where the clipped branch is the smaller one (its gradient is zero)
    mismatch KL     k3 of KL(pi_old || pi_theta) from samples of pi_old: r_t - 1 - log r_t
    ref KL          the k3 term above (beta > 0 only)
    reverse KL      log pi_old(t) - log pi_T(t), the distillation signal (with a teacher)
    top-k KL        D_t (distill_top_k > 0 only)
    masked          tokens the corrections' masks removed (and samples removed whole)
    ratio quantiles r_t at p1, p50, p99, from a histogram of log r_t (corrections.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.trainer.corrections import Corrected, correct, log_ratio_histogram, per_sample
from rl.trainer.loss_config import (
    CISPOObjective, DapoNorm, DrGrpoNorm, GrpoNorm, GSPOObjective, LossConfig, NormConfig, corrections,
)


@dataclass(frozen=True)
class StepTotals:
    """Counts over the whole step (every rank), the denominators of the normalisation."""

    samples: int
    tokens: int  # trained tokens


def sample_weight(norm: NormConfig, sample_tokens: int, totals: StepTotals, seq_len: int) -> float:
    """w_i of the module docstring for a sample with `sample_tokens` trained tokens."""
    if sample_tokens == 0:
        return 0.0
    if isinstance(norm, DapoNorm):
        return 1.0 / totals.tokens
    if isinstance(norm, GrpoNorm):
        return 1.0 / (totals.samples * sample_tokens)
    if isinstance(norm, DrGrpoNorm):
        return 1.0 / (totals.samples * (norm.tokens_per_sample or seq_len))
    raise AssertionError(f"unknown normalisation {norm!r}")


@dataclass
class LossStats:
    clipped_tokens: torch.Tensor  # scalar, tokens whose ratio (or weight) was clipped
    mismatch_kl_sum: torch.Tensor  # scalar, sum over tokens of r_t - 1 - log r_t
    ref_kl_sum: torch.Tensor  # scalar, sum over tokens of the k3 penalty (0 without reference)
    masked_tokens: torch.Tensor  # scalar, trained tokens the corrections' masks removed
    reverse_kl_sum: torch.Tensor  # scalar, sum over tokens of log pi_old - log pi_T (0 without a teacher)
    top_k_kl_sum: torch.Tensor  # scalar, sum over tokens of D_t (0 unless distill_top_k > 0)
    samples: torch.Tensor  # scalar, samples with a trained token
    masked_samples: torch.Tensor  # scalar, those the masks removed whole
    ratio_histogram: torch.Tensor  # [bins] counts of the trained tokens' log ratios (corrections.py)


def policy_loss(
    logprobs: torch.Tensor,  # [B, T] trainer logprobs of the tokens (requires grad)
    old_logprobs: torch.Tensor,  # [B, T] inference logprobs
    advantages: torch.Tensor,  # [B, T] advantage of each token's sample
    mask: torch.Tensor,  # [B, T] bool, tokens that are trained on
    weights: torch.Tensor,  # [B, T] w_i of each token's sample
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,  # [B, T] reference logprobs, when beta > 0
    teacher_logprobs: torch.Tensor | None = None,  # [B, T] the teacher's logprobs, when distill > 0
    distill_baseline: float = 0.0,  # b: the step's mean reverse KL, when distill > 0 and loss.distill_baseline
    top_k_kl: torch.Tensor | None = None,  # [B, T] D_t with gradient (the output head's), when distill_top_k > 0
    position_ids: torch.Tensor | None = None,  # [B, T] restarting at 0 for each sample; None: a sample per row
    rescored_logprobs: torch.Tensor | None = None,  # [B, T] inference's under the trained policy (a mask's `against`)
) -> tuple[torch.Tensor, LossStats]:
    if position_ids is None:
        position_ids = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    reverse_kl = torch.zeros_like(old_logprobs)
    if teacher_logprobs is not None:
        reverse_kl = old_logprobs - teacher_logprobs  # [B, T]
    if teacher_logprobs is not None and config.distill > 0:
        advantages = config.reward_weight * advantages - config.distill * (reverse_kl - distill_baseline)
    elif config.reward_weight != 1:
        advantages = config.reward_weight * advantages
    log_ratio = logprobs - old_logprobs  # [B, T]
    ratio = torch.exp(log_ratio)
    rescored_log_ratio = None if rescored_logprobs is None else logprobs - rescored_logprobs
    fixed = correct(log_ratio, mask, position_ids, corrections(config.mismatch), rescored_log_ratio)
    per_token, clipped = objective(logprobs, log_ratio, advantages, mask, config, fixed)
    ref_kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and config.beta > 0:
        q = ref_logprobs - logprobs
        ref_kl = torch.exp(q) - q - 1  # [B, T]
        per_token = per_token + config.beta * ref_kl
    if top_k_kl is not None and config.distill_top_k > 0:
        per_token = per_token + config.distill_top_k * top_k_kl
    else:
        top_k_kl = torch.zeros_like(per_token)
    loss = (per_token * weights * fixed.scale * fixed.keep).sum()
    with torch.no_grad():
        fmask = mask.to(per_token.dtype)
        stats = LossStats(
            clipped_tokens=(clipped & mask).sum().to(per_token.dtype),
            mismatch_kl_sum=((ratio - 1 - log_ratio) * fmask).sum(),
            ref_kl_sum=(ref_kl * fmask).sum(),
            masked_tokens=(mask & ~fixed.keep).sum().to(per_token.dtype),
            reverse_kl_sum=(reverse_kl * fmask).sum(),
            top_k_kl_sum=(top_k_kl.detach() * fmask).sum(),
            samples=fixed.sequences,
            masked_samples=fixed.masked_sequences,
            ratio_histogram=log_ratio_histogram(log_ratio, mask),
        )
    return loss, stats


def objective(logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              config: LossConfig, fixed: Corrected) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's policy loss L_t [B, T] under `config.objective`, and [B, T] bool: where its ratio (or, for
    CISPO, its weight) was clipped."""
    cap = fixed.ratio_cap if fixed.ratio_cap is not None else float("inf")
    if isinstance(config.objective, CISPOObjective):
        weight = log_ratio.detach().exp()
        limit = min(cap, config.objective.max_weight)
        return -weight.clamp(max=limit) * advantages * logprobs, weight > limit
    low, high = 1 - config.eps_low, 1 + config.eps_high
    ratio = log_ratio.exp()
    if isinstance(config.objective, GSPOObjective):
        trained = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))
        mean = per_sample(trained, fixed.ids) / fixed.counts.clamp(min=1)
        ratio = torch.exp(mean + logprobs - logprobs.detach())  # the sample's ratio in value, each token's gradient
        low, high = 1 - config.objective.eps_low, 1 + config.objective.eps_high
    unclipped = ratio.clamp(max=cap) * advantages
    clipped = ratio.clamp(low, high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


MOMENT_KEYS = ("lp_n", "lp_x", "lp_y", "lp_xx", "lp_yy", "lp_xy")


def logprob_moments(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[6] float64 sums over the trained tokens of 1, x, y, x^2, y^2 and xy (x the trainer's logprob, y inference's):
    summed over micro-batches and ranks, they give the step's correlation (`moments_correlation`)."""
    zero = logprobs.new_zeros((), dtype=torch.float64)  # masked by where, not by indexing: no host sync on a GPU
    x, y = torch.where(mask, logprobs.double(), zero), torch.where(mask, old_logprobs.double(), zero)
    return torch.stack([mask.double().sum(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])


def moments_correlation(sums: dict[str, float]) -> float | None:
    """Pearson's correlation of trainer and inference logprobs over the step's trained tokens (verl's
    rollout-trainer correlation: 1 when the two agree up to an affine map; what the mismatch KL measures in nats it
    shows as agreement of shape); None without two distinct logprobs on either side."""
    n, sx, sy = sums["lp_n"], sums["lp_x"], sums["lp_y"]
    var_x, var_y = n * sums["lp_xx"] - sx * sx, n * sums["lp_yy"] - sy * sy
    if var_x <= 0 or var_y <= 0:
        return None
    return (n * sums["lp_xy"] - sx * sy) / (var_x * var_y) ** 0.5
