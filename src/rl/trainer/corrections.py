"""Off-policy and train-inference mismatch corrections (`trainer.loss.mismatch`, a list that stacks).

A token's ratio r_t = pi_theta(t) / pi_old(t) compares the policy being trained with the one inference sampled the
token from: it holds both the policy's steps since then (asynchrony) and the numerical differences of the two
engines (mismatch). Each correction reads the ratios (detached) of the trained tokens and either removes tokens from
the loss (a mask) or scales their loss down (a truncation); sequence-level ones decide for all the tokens of a
sample at once. For sample i with trained tokens T_i (n_i of them):

    truncate      r~_t = min(r_t, C) in the unclipped branch                     token (truncated IS)
    mask          m_t = 0 if |log r_t| > B                                      token (prime-rl's default on GPUs)
    icepop        m_t = 0 if r_t < low or r_t > high                            token (IcePop)
    geo_mask      m_t = 0 for t in T_i if g_i < low or g_i > high,              sequence (geometric mean ratio)
                  g_i = exp(mean_{t in T_i} log r_t)
    seq_truncate  s_t = min(1, C / rho_i) for t in T_i, rho_i = prod_{t in T_i} r_t    sequence (truncated IS)
    outlier_mask  m_t = 0 for t in T_i if some u in T_i has r_u < low or r_u > high     sequence (outlier tokens)

A mask may read another ratio instead (`against = "rescored"`): pi_theta(t) over inference's probability of the
same token under pi_theta's own weights, which the orchestrator re-scores by prefill for a stale sample
(orchestrator/rescore.py). It holds the engines' difference alone, so a tight sequence mask (SkyRL's [0.99, 1.01])
rejects mismatch without rejecting every sample an asynchronous run trains a few steps late.

Every correction is computed from the same ratios, whatever else is in the list: the masks multiply (a token is
kept if every mask keeps it), the scales multiply and the token cap is the smallest, so the order of the list does
not matter and a stack of two is their composition. Samples are told apart by their positions, which restart at 0
for every sample of a (packed) row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl.trainer.loss_config import GeoMask, IcePopMask, MaskRatio, OutlierMask, SequenceTruncate, TruncateRatio

# Quantiles of the trained tokens' ratios come from a histogram of log r_t, summed over micro-batches and ranks:
# HISTOGRAM_BINS bins of width 2 * LOG_RATIO_RANGE / HISTOGRAM_BINS, with one more below and one above.
LOG_RATIO_RANGE = 2.0
HISTOGRAM_BINS = 400


@dataclass
class Corrected:
    keep: torch.Tensor  # [B, T] bool: trained tokens every mask keeps
    scale: torch.Tensor  # [B, T] float: product of the sequence truncations' scales (1 where none)
    ratio_cap: float | None  # the smallest token truncation cap, None without one
    sequences: torch.Tensor  # scalar: samples with a trained token
    masked_sequences: torch.Tensor  # scalar: those of them with no token kept
    ids: torch.Tensor  # [B, T] each token's sample (sample_ids)
    counts: torch.Tensor  # [B, T] its sample's trained tokens


def sample_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] long: a number for each token's sample, distinct over the micro-batch (a sample starts where its
    position is 0)."""
    rows, width = position_ids.shape
    within_row = (position_ids == 0).long().cumsum(dim=1) - 1
    return within_row.clamp(min=0) + torch.arange(rows, device=position_ids.device)[:, None] * width


def sample_sums(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B * T]: the sum of `values` [B, T] over each sample, at its number (0 where no sample has it)."""
    return values.new_zeros(ids.numel()).index_add_(0, ids.flatten(), values.flatten())


def per_sample(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sum of `values` [B, T] over each sample, spread back onto its tokens: [B, T]."""
    return sample_sums(values, ids)[ids]


def correct(log_ratio: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, corrections: list,
            rescored_log_ratio: torch.Tensor | None = None) -> Corrected:
    """Apply `corrections` to the trained tokens (`mask`) given their log ratios (detached): to the sampling
    logprobs, and for a mask `against = "rescored"`, `rescored_log_ratio`, to inference's under the trained policy."""
    sampled = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))
    rescored = None if rescored_log_ratio is None else torch.where(mask, rescored_log_ratio.detach(),
                                                                   torch.zeros_like(log_ratio))
    keep, scale, caps = mask.clone(), torch.ones_like(log_ratio), []
    ids = sample_ids(position_ids)
    counts = per_sample(mask.to(log_ratio.dtype), ids)
    for c in corrections:
        log_ratio = sampled if getattr(c, "against", "sampled") == "sampled" else rescored
        if log_ratio is None:
            raise ValueError(f"{c.type} against = 'rescored' needs inference's logprobs under the trained policy: the "
                             "batch holds none (orchestrator.rescore)")
        ratio = log_ratio.exp()
        if isinstance(c, TruncateRatio):
            caps.append(c.cap)
        elif isinstance(c, MaskRatio):
            keep &= log_ratio.abs() <= c.max_log_ratio
        elif isinstance(c, IcePopMask):
            keep &= (ratio >= c.low) & (ratio <= c.high)
        elif isinstance(c, GeoMask):
            geometric = (per_sample(log_ratio, ids) / counts.clamp(min=1)).exp()
            keep &= (geometric >= c.low) & (geometric <= c.high)
        elif isinstance(c, SequenceTruncate):  # min(1, C / rho) in log space: rho overflows for long samples
            scale = scale * (math.log(c.cap) - per_sample(log_ratio, ids)).clamp(max=0).exp()
        elif isinstance(c, OutlierMask):
            outliers = mask & ((ratio < c.low) | (ratio > c.high))
            keep &= per_sample(outliers.to(log_ratio.dtype), ids) == 0
        else:
            raise AssertionError(f"unknown correction {c!r}")
    trained = sample_sums(mask.to(log_ratio.dtype), ids) > 0
    untouched = sample_sums(keep.to(log_ratio.dtype), ids) == 0
    return Corrected(keep, scale, min(caps) if caps else None, trained.sum().to(log_ratio.dtype),
                     (trained & untouched).sum().to(log_ratio.dtype), ids, counts)


def log_ratio_histogram(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[HISTOGRAM_BINS + 2] float64 counts of the trained tokens' log r_t (below the range, the bins, above it)."""
    width = 2 * LOG_RATIO_RANGE / HISTOGRAM_BINS
    index = ((log_ratio.detach().double() + LOG_RATIO_RANGE) / width).floor().clamp(-1, HISTOGRAM_BINS) + 1
    counts = torch.zeros(HISTOGRAM_BINS + 2, dtype=torch.float64, device=log_ratio.device)
    return counts.index_add_(0, index.long().flatten(), mask.double().flatten())


def ratio_quantile(histogram: list[float], q: float) -> float | None:
    """The ratio r at quantile q of the histogram's tokens (the middle of its bin; the range's edge for a token
    beyond it); None without tokens."""
    total = sum(histogram)
    if total <= 0:
        return None
    width, running = 2 * LOG_RATIO_RANGE / HISTOGRAM_BINS, 0.0
    for index, count in enumerate(histogram):
        running += count
        if running >= q * total:
            if index == 0:
                return math.exp(-LOG_RATIO_RANGE)
            if index == len(histogram) - 1:
                return math.exp(LOG_RATIO_RANGE)
            return math.exp(-LOG_RATIO_RANGE + (index - 0.5) * width)
    return math.exp(LOG_RATIO_RANGE)
