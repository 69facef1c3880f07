"""Re-scoring a batch's older samples under the policy it trains (`orchestrator.rescore`), so that a mask
`against = "rescored"` measures the engines' difference alone.

A sample sampled under policy v < k and trained in batch k carries inference's logprobs under v; the trainer's ratio to
them holds the k - v policy steps since beside the train/inference mismatch, and a sequence mask tight enough for the
mismatch (SkyRL's [0.99, 1.01]) rejects nearly every stale sample (benchmarks/off_policy.py). So once the servers serve
policy k, each such sample is prefilled there with `prompt_logprobs = 0`, as a teacher scores (orchestrator/teacher.py):
inference's logprob of every token under the weights the trainer holds for batch k. A sample wholly sampled under k
keeps its own logprobs. Prompt logprobs are untempered, so this needs sampling temperature 1 (the config says so).

A mixture of experts routes the prefill anew while the trainer replays the routes recorded at sampling; the ratio then
holds the routing difference too."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from rl.orchestrator.config import TeacherConfig
from rl.orchestrator.teacher import Teacher, TeacherError
from rl.samples import Sample


def sampled_under(sample: Sample) -> int:
    """The oldest policy behind the sample's tokens."""
    return min(sample.token_versions) if sample.token_versions else sample.policy_version


def policy_scorers(urls: list[str], model: str, timeout_s: float) -> list[Teacher]:
    """A scorer for each policy server at `urls`, requests naming `model` (the policy's, or its LoRA adapter's)."""
    return [Teacher(TeacherConfig(base_url=url, model=model, timeout_s=timeout_s)) for url in urls]


async def rescore(samples: list[Sample], step: int, scorers: list[Teacher]) -> tuple[list[Sample], int]:
    """The samples with `rescored_logprobs` under policy `step`, which the servers of every scorer serve (the older
    samples spread over them), and how many were re-scored."""
    stale = [i for i, s in enumerate(samples) if sampled_under(s) < step]
    if any(samples[i].pixel_values is not None for i in stale):
        raise TeacherError(f"batch {step} holds samples with images sampled under an older policy: re-scoring sends "
                           "token ids alone, so it cannot score them; unset the masks' against = 'rescored'")
    shares = [share for share in (stale[i::len(scorers)] for i in range(len(scorers))) if share]  # the first ones
    scored = await asyncio.gather(*(score_on(scorer, [samples[i] for i in share], step)
                                    for scorer, share in zip(scorers, shares)))
    rescored = {i: s.teacher_logprobs for share, part in zip(shares, scored) for i, s in zip(share, part)}
    return [replace(s, rescored_logprobs=rescored.get(i, s.logprobs)) for i, s in enumerate(samples)], len(stale)


async def score_on(scorer: Teacher, samples: list[Sample], step: int) -> list[Sample]:
    try:
        return await scorer.score(samples)
    except TeacherError as e:
        raise TeacherError(f"re-scoring batch {step} on the server at {scorer.config.base_url} (prefilled as a "
                           f"teacher scores; 'the teacher' is that server): {e}") from e
