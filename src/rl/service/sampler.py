"""Sampling for the service: rl's vLLM servers, moved to the policy a sampling session names before it samples.

Servers serve one policy at a time. A sample for policy k waits until no sample of another policy is in flight, then
the servers reload weights/step_k (each verifies what it loaded against the step's checksum, as in `rl`) and report
what they serve; every sample is answered under that report."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from itertools import cycle
from pathlib import Path

import httpx

from rl.config import API_KEY_VAR
from rl.orchestrator.inference_pool import InferencePool
from rl.protocol import RunPaths, wait_for_stable
from rl.service.wire import Sequence


WRITTEN_POLL_S = 0.002  # a tiny model's step is written in ~10 ms


class SampleError(ValueError):
    """A sample rl cannot take (named; HTTP 400)."""


class ServedPolicy:
    """Which policy the servers serve, and the samples in flight under it."""

    def __init__(self, pool: InferencePool, paths: RunPaths, timeout_s: float, log=lambda message: None):
        self.pool, self.paths, self.timeout_s, self.log = pool, paths, timeout_s, log
        self.step, self.proof = 0, None  # the base model at start; proof: what each server reported serving
        self.in_flight = 0
        self.changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def serving(self, step: int) -> AsyncIterator[list[dict] | None]:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.step == step or not self.in_flight),
                                       self.timeout_s)
            except TimeoutError:
                raise TimeoutError(f"waited {self.timeout_s:.0f}s for the samples of policy {self.step} in flight to "
                                   f"finish before policy {step} could be loaded") from None
            if self.step != step:
                await self.load(step)
            self.in_flight += 1
        try:
            yield self.proof
        finally:
            async with self.changed:
                self.in_flight -= 1
                self.changed.notify_all()

    async def written(self, step: int, path: Path) -> None:
        """A saved step's weights are written by the trainer's writer thread after its save was answered: wait
        for its STABLE marker, within the deadline."""
        try:
            await asyncio.to_thread(wait_for_stable, path, self.timeout_s, f"policy {step}'s weights", WRITTEN_POLL_S)
        except TimeoutError:
            raise SampleError(f"policy {step}'s weights ({path}) were not written within {self.timeout_s:.0f}s of its "
                              "save: see the trainer's log") from None

    async def load(self, step: int) -> None:
        if step < self.step:
            raise SampleError(f"policy {step} is older than policy {self.step}, which the servers now serve: rl's "
                              "servers only move to newer policies")
        path = self.paths.weights(step)
        await self.written(step, path)
        self.proof = await self.pool.update_weights(step, str(path.absolute()))
        self.step = step
        checksums = sorted({str(served.get("weights_checksum")) for served in self.proof})
        self.log(f"the servers serve policy {step}, verified against its checksum {', '.join(checksums)}")


class Sampler:
    def __init__(self, base_urls: list[str], model: str, served: ServedPolicy, timeout_s: float):
        key = os.environ.get(API_KEY_VAR)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self.urls = cycle([u.rstrip("/") for u in base_urls])
        self.model, self.served = model, served

    async def close(self) -> None:
        await self.http.aclose()

    async def sample(self, step: int, request: dict) -> tuple[list[Sequence], list[float | None] | None, list]:
        """The sequences asked for, the prompt's logprobs (if asked) and the proof of what served them."""
        prompt = prompt_tokens(request)
        params = request.get("sampling_params", {})
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if request.get(name):
                raise SampleError(f"{name} = {request[name]}: rl serve-api does not return top-k logprobs yet")
        if request.get("target_prompt_logprobs") is not None:
            raise SampleError("target_prompt_logprobs: rl serve-api does not score given prompt targets yet")
        body = {
            "model": self.model, "prompt": prompt, "n": request.get("num_samples", 1),
            "max_tokens": params.get("max_tokens") or 16, "temperature": params.get("temperature", 1.0),
            "top_p": params.get("top_p", 1.0), "top_k": params.get("top_k", -1), "logprobs": 0,
            "return_token_ids": True, **({"seed": params["seed"]} if params.get("seed") is not None else {}),
            **stop_of(params.get("stop")),
            **({"prompt_logprobs": 0} if request.get("prompt_logprobs") else {}),
        }
        async with self.served.serving(step) as proof:
            url = next(self.urls)
            response = await self.http.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            raise SampleError(f"inference refused the sample: {response.status_code} {response.text[:500]}")
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        sequences = [Sequence(c["token_ids"], [float(v) for v in c["logprobs"]["token_logprobs"]],
                              c["finish_reason"] != "length") for c in choices]
        scored = None
        if request.get("prompt_logprobs"):
            scored = [None if entry is None else float(entry[str(token)]["logprob"])
                      for token, entry in zip(prompt, choices[0]["prompt_logprobs"])]
        return sequences, scored, proof or []


def prompt_tokens(request: dict) -> list[int]:
    tokens = []
    for chunk in request.get("prompt", {}).get("chunks", []):
        if chunk.get("type") != "encoded_text":
            raise SampleError(f"a prompt chunk of type {chunk.get('type')!r}: rl serve-api samples from encoded text")
        tokens += chunk["tokens"]
    if not tokens:
        raise SampleError("the prompt holds no token")
    return tokens


def stop_of(stop) -> dict:
    """Tinker's stop (strings, or token ids) as vLLM's."""
    if stop is None or stop == []:
        return {}
    if isinstance(stop, str):
        return {"stop": [stop]}
    if all(isinstance(s, int) for s in stop):
        return {"stop_token_ids": list(stop)}
    return {"stop": list(stop)}
