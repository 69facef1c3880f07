"""Assemble one trainer step's batch: samples from finished groups (advantages, gates, the policy version of every
sampled token), what was dropped and why, and the samples balanced across trainer ranks by tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from rl.envs.rollouts import GroupOutcome, RolloutResult, TokenSegment
from rl.orchestrator.advantage import admitted, group_advantages
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.vision import ImageTokenSampled, image_inputs
from rl.samples import Sample


@dataclass
class StepBatch:
    samples: list[Sample]
    kept: dict[str, list[RolloutResult]] = field(default_factory=dict)  # scored results by env name
    dropped: Counter = field(default_factory=Counter)  # rollouts (samples, once split) dropped, by reason
    dropped_by_env: Counter = field(default_factory=Counter)  # the same, by env name
    dropped_groups: Counter = field(default_factory=Counter)  # groups left out whole, by env name
    served_at_finish: list[int] = field(default_factory=list)  # per sample: the policy served when its group ended
    unrouted: int = 0  # MoE: samples whose server recorded no routed experts (the trainer routes them itself)
    withheld: int = 0  # rollouts whose oldest token is past the age bound: in their group's baseline, not trained
    trained: list[RolloutResult] = field(default_factory=list)  # rollouts with a trained token

    def drop(self, reason: str, env: str, count: int) -> None:
        self.dropped[reason] += count
        self.dropped_by_env[env] += count

    def drop_group(self, reason: str, env: str, count: int) -> None:
        self.drop(reason, env, count)
        self.dropped_groups[env] += 1


def build_batch(config: OrchestratorConfig, outcomes: list[GroupOutcome], served_at_finish: list[int],
                groups_wanted: int, oldest_allowed: int | None = None) -> StepBatch:
    """The step's samples, group by group in order; with fill_batch, at most `groups_wanted` groups (a fill round
    that overshot leaves its last trainable groups out, as `batch_full`). `served_at_finish`: per group, the oldest
    policy the servers served when it ended. A rollout with a token older than `oldest_allowed` is withheld."""
    batch, groups, n = StepBatch([]), 0, config.rollouts_per_example
    for outcome, served in zip(outcomes, served_at_finish, strict=True):
        if outcome.results is None:
            batch.drop_group(f"group_failed:{outcome.error}", outcome.env.name, n)
            continue
        if config.advantage.fill_batch and groups == groups_wanted:
            batch.drop_group("batch_full", outcome.env.name, n)
            continue
        if outcome.unscored:
            batch.drop("reward_not_finite", outcome.env.name, outcome.unscored)
        batch.kept.setdefault(outcome.env.name, []).extend(outcome.results)
        samples = group_samples(config, outcome, batch, oldest_allowed)
        groups += bool(samples)
        batch.samples.extend(samples)
        batch.served_at_finish.extend([served] * len(samples))
    if not batch.samples:
        raise RuntimeError(f"no rollout of the step is trainable ({dict(batch.dropped)}){failures(outcomes)}")
    batch.unrouted = route_all_or_none(batch.samples)
    keep = len(batch.samples) - len(batch.samples) % config.trainer_world_size
    batch.dropped["uneven_for_ranks"] += len(batch.samples) - keep
    batch.samples, batch.served_at_finish = batch.samples[:keep], batch.served_at_finish[:keep]
    return batch


def routed_rows(rows) -> torch.Tensor:
    """An MoE's routed experts as a batch holds them: int16 [tokens, layers, top_k], from an array of rows (vLLM's
    uint8 or uint16)."""
    return torch.from_numpy(np.asarray(rows).astype(np.int16))


def unrecorded_last(rows: torch.Tensor) -> torch.Tensor:
    """The last token's row marked not recorded (-1): inference never runs its model on a rollout's last token, and
    verifiers fills its row with a copy of the one before (the trainer routes that token itself)."""
    rows[-1] = -1
    return rows


def route_all_or_none(samples: list[Sample]) -> int:
    """A batch's samples carry routed experts all or none: where some do (an MoE, router replay), each that lacks
    them gets rows of -1 (the trainer routes those tokens itself). How many lacked them."""
    shapes = [s.routed_experts.shape[1:] for s in samples if s.routed_experts is not None]
    if not shapes:
        return 0
    unrouted = [s for s in samples if s.routed_experts is None]
    for sample in unrouted:
        sample.routed_experts = torch.full((len(sample.input_ids), *shapes[0]), -1, dtype=torch.int16)
    return len(unrouted)


def group_samples(config: OrchestratorConfig, outcome: GroupOutcome, batch: StepBatch,
                  oldest_allowed: int | None = None) -> list[Sample]:
    """A group's samples. Every rollout's reward is in the group's baseline; one whose oldest token is older than
    `oldest_allowed` (its episode outlived the age bound) is then withheld, alone, and counted."""
    results, env = outcome.results, outcome.env.name
    computed = group_advantages(config.advantage, [r.reward for r in results], [r.is_truncated for r in results])
    if computed is None:
        batch.drop_group("zero_variance_group", env, len(results))
        return []
    samples = []
    for result, advantage, trainable in zip(results, *computed):
        if oldest_allowed is not None and rollout_oldest_version(result, outcome.policy_step) < oldest_allowed:
            batch.withheld += 1
            batch.drop("older_than_max_off_policy_steps", env, len(result.segments))
            continue
        if not admitted(config.advantage, advantage):
            batch.drop("advantage_gate", env, len(result.segments))
            continue
        kept = [s for s in result.segments if len(s.prompt_ids) + len(s.completion_ids) <= config.seq_len]
        if len(kept) < len(result.segments):
            batch.drop("longer_than_seq_len", env, len(result.segments) - len(kept))
        for segment in kept:
            try:
                samples.append(with_images(config, segment, to_sample(segment, result.reward, advantage,
                                                                      outcome.policy_step, trainable)))
            except ImageTokenSampled:
                batch.drop("sampled_an_image_token", env, 1)
        if trainable and kept:
            batch.trained.append(result)
    return samples


def sampled_versions(segment: TokenSegment, dispatched: int) -> list[int]:
    """The policy version of each sampled token of the segment, as its server labelled it; a token without a label
    takes the policy served when its group was dispatched, which is never newer than the real one."""
    labels = segment.completion_versions or [None] * len(segment.completion_ids)
    return [dispatched if label is None else label for label, sampled in zip(labels, segment.completion_mask)
            if sampled]


def group_oldest_version(outcome: GroupOutcome) -> int:
    """The oldest policy among a finished group's sampled tokens (the dispatch policy where it has none)."""
    return min((rollout_oldest_version(r, outcome.policy_step) for r in outcome.results or ()),
               default=outcome.policy_step)


def rollout_oldest_version(result: RolloutResult, dispatched: int) -> int:
    """The oldest policy among a rollout's sampled tokens (`dispatched` where it has none)."""
    return min((v for segment in result.segments for v in sampled_versions(segment, dispatched)), default=dispatched)


def to_sample(
    segment: TokenSegment, reward: float, advantage: float, dispatched: int, trainable: bool = True
) -> Sample:
    """Prompt tokens and environment tokens are masked; an untrainable (masked) rollout has no loss tokens. Every
    token carries a policy version: a sampled one the version that sampled it, the others the sample's oldest
    (`policy_version`)."""
    prompt = len(segment.prompt_ids)
    mask = segment.completion_mask if trainable else [0] * len(segment.completion_mask)
    sampled = iter(sampled_versions(segment, dispatched))
    oldest = min(sampled_versions(segment, dispatched), default=dispatched)
    versions = [next(sampled) if m else oldest for m in segment.completion_mask]
    return Sample(
        input_ids=segment.prompt_ids + segment.completion_ids,
        loss_mask=[0] * prompt + mask,
        logprobs=[0.0] * prompt + segment.completion_logprobs,
        advantage=advantage,
        reward=reward,
        policy_version=oldest,
        token_versions=[oldest] * prompt + versions,
        routed_experts=None if segment.routed_experts is None else unrecorded_last(routed_rows(segment.routed_experts)),
    )


def with_images(config: OrchestratorConfig, segment: TokenSegment, sample: Sample) -> Sample:
    """The sample with the pixel inputs of its segment's images, if it has any (rl/orchestrator/vision.py)."""
    if segment.images:
        sampled = [0] * len(segment.prompt_ids) + segment.completion_mask
        inputs = image_inputs(config.model.name)(segment.images, sample.input_ids, sampled)
        sample.pixel_values, sample.image_grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
    return sample


def off_policy_stats(step: int, batch: StepBatch) -> dict:
    """How old the trained tokens are at `step` (mean over loss tokens, max), and each sample's age split into the
    part gained in flight (its oldest token to the policy served when its group ended) and the part gained waiting
    for this batch (from then to `step`), averaged over samples."""
    ages, in_flight, in_queue = [], [], []
    for sample, served in zip(batch.samples, batch.served_at_finish):
        ages.extend(step - v for v, m in zip(sample.token_versions, sample.loss_mask) if m)
        flight = max(0, served - sample.policy_version)
        in_flight.append(flight)
        in_queue.append(step - sample.policy_version - flight)
    count = max(len(batch.samples), 1)
    return {"off_policy/mean": sum(ages) / max(len(ages), 1), "off_policy/max": max(ages, default=0),
            "off_policy/in_flight": sum(in_flight) / count, "off_policy/in_queue": sum(in_queue) / count,
            **length_bias_stats(batch)}


def length_bias_stats(batch: StepBatch) -> dict:
    """What was not trained, beside what was: rollouts withheld for age, the share of the finished rollouts'
    sampled tokens that no sample trains, and the mean length and turns of trained rollouts (to hold against
    `completion_len` and `num_turns`, those of every finished one)."""
    finished = sum(r.sampled_tokens for rs in batch.kept.values() for r in rs)
    trained_tokens = sum(sum(s.loss_mask) for s in batch.samples)
    count = max(len(batch.trained), 1)
    return {
        "off_policy/withheld": batch.withheld,
        "off_policy/discarded_tokens": 1 - trained_tokens / finished if finished else 0.0,
        "off_policy/trained_len": sum(r.sampled_tokens for r in batch.trained) / count,
        "off_policy/trained_turns": sum(r.num_turns for r in batch.trained) / count,
    }


def failures(outcomes: list[GroupOutcome]) -> str:
    """Per environment with failed groups: how its seats run, how many groups failed, and the first error."""
    lines = []
    for env in {id(o.env): o.env for o in outcomes if o.results is None}.values():
        failed = [o for o in outcomes if o.env is env and o.results is None]
        total = sum(o.env is env for o in outcomes)
        first = failed[0]
        lines.append(f"\n  {env.describe()}\n    {len(failed)} of {total} groups failed, "
                     f"first: {first.error}: {first.message}")
    return "".join(lines)


def balance_by_tokens(samples: list[Sample], ranks: int) -> list[list[Sample]]:
    """Equal sample counts per rank; longest samples first to the rank with the fewest tokens so far."""
    if len(samples) % ranks:
        raise ValueError(f"{len(samples)} samples cannot be split evenly over {ranks} trainer ranks")
    per_rank = len(samples) // ranks
    buckets: list[list[Sample]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        open_ranks = [r for r in range(ranks) if len(buckets[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: tokens[r])
        buckets[rank].append(sample)
        tokens[rank] += len(sample.input_ids)
    return buckets
