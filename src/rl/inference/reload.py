"""Load and verify: a staged step reloaded on every vLLM worker (every tensor-parallel rank, rl.inference.worker) and
what each then serves verified against the step's checksum; the base model's weights verified once at start-up; and a
one-token probe that proves what is served computes finite logprobs. Nothing here decides which step is served
(rl.inference.policy does)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator

from rl.inference import hooks
from rl.inference.reports import merge_reports
from rl.inference.staging import StagedStep

PROBE_TOKENS = [0, 1, 2]  # any ids of the vocabulary


@contextlib.asynccontextmanager
async def prefix_cache_dropped(engine, drop: bool) -> AsyncIterator[None]:
    """Where `drop`, vLLM's prefix cache (running requests' KV included) is reset while the block runs."""
    reset = asyncio.create_task(engine.reset_prefix_cache(reset_running_requests=True)) if drop else None
    try:
        yield
    finally:
        if reset is not None:
            await reset


class Reload:
    """The reload and verification on a server's workers (`engine`: vLLM's engine client); `base_model`: the
    directory the weights loaded at start-up came from."""

    def __init__(self, engine, base_model: str, reset_cache: bool = False):
        self.engine, self.base_model, self.reset_cache = engine, base_model, reset_cache

    async def load(self, staged: StagedStep | None, step: int) -> dict:
        """Reload on every worker from the staged step's files (None: the base model's directory), and verify what
        each then serves; once verified, vLLM labels what it samples with `step`. The merged report.

        Needs generation held (no KV is computed until it is released). KV computed under the weights before is
        kept from later requests by the gate's per-policy cache salt; with `reset_cache` instead, the prefix cache
        is dropped while the workers reload: running requests are preempted and their prompts and tokens so far
        recomputed with the new weights when generation resumes.
        """
        args = (None, self.base_model) if staged is None else (staged.rpc(), None)
        faults = hooks.reload_faults()
        async with prefix_cache_dropped(self.engine, self.reset_cache):
            report = merge_reports(await self.engine.collective_rpc("rl_load_weights", args=(*args, faults)))
        if staged is not None:
            report["bytes_read"] = staged.bytes
        if report["ok"]:
            await self.engine.update_weight_version(str(step))
        return report

    async def verify_base(self, path: str) -> dict:
        """Verify that the weights loaded at start-up are those of `path` (step 0, labelled so once verified); the
        merged report."""
        report = merge_reports(await self.engine.collective_rpc("rl_check_served", args=(path,)))
        if report["ok"]:
            await self.engine.update_weight_version("0")
        return report

    async def probe(self, lora=None) -> bool:
        """Whether one greedy token of what is served (through the adapter `lora`, where given) has finite
        logprobs."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
        finite = True
        async for output in self.engine.generate({"prompt_token_ids": PROBE_TOKENS}, params,
                                                 f"rl-probe-{time.monotonic_ns()}", lora_request=lora):
            for completion in output.outputs:
                for entry in completion.logprobs or []:
                    finite &= all(math.isfinite(lp.logprob) for lp in entry.values())
        return finite
