"""Clipped importance-ratio policy-gradient loss (token level).

For every trained token t of sample i, with advantage A_i, trainer logprob log pi_theta(t) and the
inference logprob log pi_old(t) recorded by the orchestrator:

    r_t     = exp(log pi_theta(t) - log pi_old(t))
    L_t     = -min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
    L       = sum_t mask_t * L_t / N_tokens

N_tokens is the number of trained tokens in the whole step (all micro-batches, all ranks), so
micro-batches and ranks add up to the loss of the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossStats:
    loss_sum: torch.Tensor  # sum over tokens of L_t (before normalisation)
    clipped_tokens: torch.Tensor  # tokens whose ratio was clipped
    mismatch_kl_sum: torch.Tensor  # sum over tokens of k3(pi_theta || pi_old)


def policy_loss(
    logprobs: torch.Tensor,  # [B, T] trainer logprobs of the tokens
    old_logprobs: torch.Tensor,  # [B, T] inference logprobs
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] bool, tokens that are trained on
    eps_low: float,
    eps_high: float,
    total_tokens: int,
) -> tuple[torch.Tensor, LossStats]:
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs  # [B, T]
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    loss_sum = (per_token * mask).sum()
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(mask.dtype) * mask
        k3 = torch.exp(-log_ratio) - 1 + log_ratio  # unbiased KL estimator, >= 0
        stats = LossStats(loss_sum.detach(), was_clipped.sum(), (k3 * mask).sum())
    return loss_sum / max(total_tokens, 1), stats
