"""One optimizer step on a rank's samples: weigh, micro-batch, forward/backward, clip, step."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from rl.samples import Sample
from rl.trainer.config import TrainerConfig
from rl.trainer.corrections import HISTOGRAM_BINS, ratio_quantile
from rl.trainer.data import MicroBatch, build_micro_batches, empty_micro_batch, trained_tokens, truncate
from rl.trainer.lora import adapters_disabled
from rl.trainer.loss_config import needs_rescored
from rl.trainer.loss import (
    MOMENT_KEYS, StepTotals, logprob_moments, moments_correlation, policy_loss, sample_weight,
)
from rl.trainer.model import forward_logprobs, forward_scores
from rl.trainer.moe import aux_loss, check_routed, follow_records, moe_blocks, router_metrics
from rl.trainer.output_head import TeacherTopK
from rl.trainer.optim import clip_gradients
from rl.trainer.world import World

RATIO_BIN_KEYS = tuple(f"ratio_bin_{i}" for i in range(HISTOGRAM_BINS + 2))
SUM_KEYS = ("loss", "clipped", "mismatch_kl", "ref_kl", "masked", "entropy", "reverse_kl", "top_k_kl",
            "aux_loss", "samples", "masked_samples") + MOMENT_KEYS + RATIO_BIN_KEYS  # per mb


def train_step(policy, reference, optimizer, scheduler, samples: list[Sample], config: TrainerConfig, world: World,
               pad_id: int) -> dict:
    """Every rank calls this with its own samples; returns step metrics (identical on every rank)."""
    if config.loss.distill > 0 and any(s.teacher_logprobs is None for s in samples):
        raise ValueError(f"trainer.loss.distill = {config.loss.distill} but the batch carries no teacher logprobs: "
                         "set orchestrator.teacher (the teacher that scores each sample)")
    if config.loss.distill_top_k > 0 and any(s.teacher_top_ids is None for s in samples):
        raise ValueError(f"trainer.loss.distill_top_k = {config.loss.distill_top_k} but the batch carries no teacher "
                         "top-k: set orchestrator.teacher.top_k")
    if needs_rescored(config.loss.mismatch) and any(s.rescored_logprobs is None for s in samples):
        raise ValueError("a trainer.loss.mismatch mask with against = 'rescored' but the batch carries no rescored "
                         "logprobs: set orchestrator.rescore = true (rl sets it from the trainer's config)")
    samples = replay_routes([truncate(s, config.seq_len) for s in samples], policy, config.loss.router_replay)
    totals = step_totals(samples, world)
    weights = [sample_weight(config.loss.norm, trained_tokens(s), totals, config.seq_len) for s in samples]
    batches = build_micro_batches(samples, weights, config.row_tokens, config.micro_batch_size, config.packing, pad_id)
    count, = world.all_reduce([len(batches)], op="max")  # FSDP collectives must match across ranks
    batches += [empty_micro_batch(pad_id, config.packing)] * (int(count) - len(batches))
    # Copied before the first forward: a blocking copy from pageable host memory waits for the device's
    # queue, which is empty here but full of the previous micro-batch's backward inside the loop.
    batches = [mb.to(world.device) for mb in batches]
    baseline = distill_baseline(batches, totals, world) if config.loss.distill > 0 and config.loss.distill_baseline \
        else 0.0
    sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=world.device)  # stays on the device all step
    for i, mb in enumerate(batches):
        if i in (0, len(batches) - 1):  # the setting changes only there; each call walks every module
            set_gradient_sync(policy, world, last=i == len(batches) - 1)
        sums += forward_backward(policy, reference, mb, config, world, baseline, aux_weight=1 / len(batches))
    lr = scheduler.get_last_lr()[0]
    grad_norm = clip_gradients(policy, config.optim.max_grad_norm)  # one host sync per step
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    distilled = config.loss.distill > 0 or config.loss.distill_top_k > 0  # both need a teacher (launcher/teacher.py)
    return summarise(dict(zip(SUM_KEYS, world.all_reduce(sums.tolist()))), totals, distilled,
                     config.loss.distill_top_k > 0, world.world_size) | router_metrics(policy, world.all_reduce) | {
        "grad_norm": grad_norm, "lr": lr, "micro_batches": int(count),
    }


def replay_routes(samples: list[Sample], policy, replay: bool) -> list[Sample]:
    """The samples as the step trains them. An MoE policy routes each token to the experts inference recorded with
    `replay` on (each sample's record checked against the model; one without a record is refused), and only
    compares its routing with the record otherwise; a dense policy drops any record."""
    blocks = moe_blocks(policy)
    if not blocks:
        return [replace(s, routed_experts=None) if s.routed_experts is not None else s for s in samples]
    follow_records(policy, replay)
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            if not replay:
                continue
            raise ValueError(f"sample {i} of the batch carries no routed experts, and trainer.loss.router_replay is "
                             "on for this mixture-of-experts model: inference records them (inference.router_replay)"
                             "; or set trainer.loss.router_replay = false")
        check_routed(s.routed_experts, len(blocks), blocks[0].top_k, blocks[0].num_experts, i)
    return samples


def step_totals(samples: list[Sample], world: World) -> StepTotals:
    n, tokens = world.all_reduce([len(samples), sum(trained_tokens(s) for s in samples)])
    return StepTotals(samples=int(n), tokens=int(tokens))


def distill_baseline(batches: list[MicroBatch], totals: StepTotals, world: World) -> float:
    """The step's mean reverse KL to the teacher, log pi_old - log pi_T, over every trained token of all ranks (the
    tokens and mask the loss takes; one host sync before the first forward)."""
    local = float(sum(((mb.old_logprobs - mb.teacher_logprobs) * mb.loss_mask).sum() for mb in batches))
    total, = world.all_reduce([local])
    return total / max(totals.tokens, 1)


def set_gradient_sync(policy, world: World, last: bool) -> None:
    """Reduce gradients and reshard parameters after every micro-batch (sharded accumulation, least memory),
    except with one rank: there unsharded gradients and parameters take no more memory than sharded ones,
    so both stay unsharded until the step's last backward."""
    sync = last or world.world_size > 1
    policy.set_requires_gradient_sync(sync)
    policy.set_reshard_after_backward(sync)


def forward_backward(policy, reference, mb: MicroBatch, config: TrainerConfig, world: World,
                     baseline: float = 0.0, aux_weight: float = 1.0) -> torch.Tensor:
    """Accumulate the gradient of one micro-batch; return its sums in SUM_KEYS order, [len(SUM_KEYS)] float64
    on the micro-batch's device. Nothing here reads a value back to the host: on a GPU that would wait for
    the queued kernels once per micro-batch."""
    ref_logprobs = None
    if reference is not None:  # the policy itself with LoRA: its base model, adapters off
        base = adapters_disabled(reference) if reference is policy else contextlib.nullcontext()
        with torch.no_grad(), base:
            ref_logprobs, _ = forward_logprobs(reference, mb, config.temperature)
    teacher = TeacherTopK(mb.teacher_top_ids, mb.teacher_top_logprobs) \
        if config.loss.distill_top_k > 0 and mb.teacher_top_ids.shape[-1] else None
    logprobs, entropy, top_k_kl = forward_scores(policy, mb, config.temperature, teacher)  # [B, T] each
    loss, stats = policy_loss(
        logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, mb.weights, config.loss, ref_logprobs,
        mb.teacher_logprobs, baseline, top_k_kl, mb.position_ids, mb.rescored_logprobs,
    )
    # FSDP averages gradients over ranks; the loss is already normalised by step totals, so undo the mean. An MoE's
    # load-balancing loss is a mean: over the rank's micro-batches here, over the ranks by FSDP's.
    balance, coef = aux_loss(policy), config.loss.router_aux_loss_coef
    total = loss * world.world_size
    (total if balance is None or coef == 0 else total + coef * aux_weight * balance).backward()
    mask = mb.loss_mask.float()
    values = [loss.detach(), stats.clipped_tokens, stats.mismatch_kl_sum, stats.ref_kl_sum, stats.masked_tokens,
              (entropy.detach() * mask).sum(), stats.reverse_kl_sum, stats.top_k_kl_sum,
              torch.zeros((), device=loss.device) if balance is None else balance.detach() * aux_weight,
              stats.samples, stats.masked_samples]
    return torch.cat([torch.stack([v.to(torch.float64) for v in values]),
                      logprob_moments(logprobs.detach(), mb.old_logprobs, mb.loss_mask), stats.ratio_histogram])


def summarise(sums: dict[str, float], totals: StepTotals, teacher: bool = False, top_k: bool = False,
              ranks: int = 1) -> dict:
    """Step means over the trained tokens; `loss` is already the normalised objective; `aux_loss` (an MoE's) is a
    mean over micro-batches on each rank, summed over `ranks`."""
    denom = max(totals.tokens, 1)
    distilled = {"distill/reverse_kl": sums["reverse_kl"] / denom} if teacher else {}
    distilled |= {"moe/aux_loss": sums["aux_loss"] / ranks} if sums.get("aux_loss") else {}
    distilled |= {"distill/top_k_kl": sums["top_k_kl"] / denom} if top_k else {}
    correlation = moments_correlation(sums)
    distilled |= {} if correlation is None else {"mismatch_corr": correlation}
    histogram = [sums[key] for key in RATIO_BIN_KEYS]
    quantiles = {f"ratio_p{q}": ratio_quantile(histogram, q / 100) for q in (1, 50, 99)}
    distilled |= {key: value for key, value in quantiles.items() if value is not None}
    return distilled | {
        "loss": sums["loss"],
        "entropy": sums["entropy"] / denom,
        "clip_frac": sums["clipped"] / denom,
        "mismatch_kl": sums["mismatch_kl"] / denom,
        "ref_kl": sums["ref_kl"] / denom,
        "masked_frac": sums["masked"] / denom,
        "masked_seq_frac": sums["masked_samples"] / max(sums["samples"], 1),
        "trained_tokens": totals.tokens,
    }
