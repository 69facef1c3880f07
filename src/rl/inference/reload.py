"""Load and verify: a staged step reloaded on every vLLM worker (every tensor-parallel rank, rl.inference.worker) and
what each then serves verified against the step's checksum; the base model's weights verified once at start-up; and a
one-token probe that proves what is served computes finite logprobs. Nothing here decides which step is served
(rl.inference.policy does)."""

from __future__ import annotations

import asyncio
import math
import time

from rl.inference import hooks
from rl.inference.reports import merge_reports
from rl.inference.staging import StagedStep

PROBE_TOKENS = [0, 1, 2]  # any ids of the vocabulary


class Reload:
    """The reload and verification on a server's workers (`engine`: vLLM's engine client); `base_model`: the
    directory the weights loaded at start-up came from."""

    def __init__(self, engine, base_model: str):
        self.engine, self.base_model = engine, base_model

    async def load(self, staged: StagedStep | None, step: int) -> dict:
        """Reload on every worker from the staged step's files (None: the base model's directory), and verify what
        each then serves; once verified, vLLM labels what it samples with `step`. The merged report.

        Needs generation held (no KV is computed until it is released), so the prefix cache can be dropped
        while the worker reloads: running requests are preempted and their prompts and tokens so far
        recomputed with the new weights when generation resumes.
        """
        args = (None, self.base_model) if staged is None else (staged.rpc(), None)
        faults = hooks.reload_faults()
        reset = asyncio.create_task(self.engine.reset_prefix_cache(reset_running_requests=True))
        report = merge_reports(await self.engine.collective_rpc("rl_load_weights", args=(*args, faults)))
        await reset
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
