"""The teacher of on-policy distillation: a frozen model's vLLM server that scores each trained sample's tokens.

Each sample (prompt and completion, as the student sampled it) is sent as a prompt of token ids with
`prompt_logprobs = 0`: vLLM prefills it and returns the teacher's logprob of every token given the ones before it,
at temperature 1 (prompt logprobs are the model's own distribution). Several samples go in one request, up to
`batch_tokens` tokens; the requests of a step run at once. The trainer's loss turns log pi_T - log pi_old into each
token's distillation advantage (trainer/loss.py).

The teacher must tokenize as the student does: at start, probe texts are tokenized by the teacher's server
(`return_token_ids`) and by the student's tokenizer, and any difference refuses the run (`TeacherError`)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace

import httpx

from rl.inference.config import API_KEY_VAR
from rl.orchestrator.config import TeacherConfig
from rl.protocol import Sample

PROBES = (  # what differs first between tokenizers: words, digits, accents, CJK, emoji, chat-template markers
    "Hello, world! 12345 + 678 = 7023",
    "Größe, façade, naïve; 東京は晴れ。🙂",
    "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "def f(x):\n\treturn x ** 2  # squared\n",
)


MIN_LOGPROB = -50.0  # a token the teacher rules out (-inf) counts as this unlikely: its advantage stays finite


def tokenizer_mismatch(teacher: str, student: str, probe: str, theirs: list[int], ours: list[int]) -> str:
    return (f"the teacher {teacher!r} tokenizes {probe!r} as {theirs[:12]}... but the student {student!r} as "
            f"{ours[:12]}...: distillation compares the two models token by token, so the teacher must share the "
            "student's tokenizer")


class TeacherError(RuntimeError):
    """The teacher cannot score this run's samples: unreachable, another tokenizer, or a malformed reply."""


class Teacher:
    def __init__(self, config: TeacherConfig):
        self.config = config
        key = os.environ.get(API_KEY_VAR)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers, timeout=config.timeout_s)
        self.model = config.model

    async def start(self, tokenizer, student: str, timeout_s: float) -> None:
        """Wait for the server (at most `timeout_s`), name the served model and refuse a teacher that tokenizes
        otherwise than the student's `tokenizer`."""
        await self._wait_healthy(timeout_s)
        if self.model is None:
            listed = [m["id"] for m in (await self._call("GET", "/v1/models"))["data"]]
            if len(listed) != 1:
                raise TeacherError(f"the teacher at {self.config.base_url} serves {listed}: set teacher.model")
            self.model = listed[0]
        for probe in PROBES:
            reply = await self._call("POST", "/v1/completions", json={
                "model": self.model, "prompt": probe, "max_tokens": 1, "return_token_ids": True})
            theirs, ours = reply["choices"][0]["prompt_token_ids"], tokenizer(probe)["input_ids"]
            if theirs != ours:
                raise TeacherError(tokenizer_mismatch(self.model, student, probe, theirs, ours))

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (await self.http.get("/health", timeout=5)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TeacherError(f"the teacher at {self.config.base_url} did not answer /health within {timeout_s} s")
            await asyncio.sleep(1)

    async def score(self, samples: list[Sample]) -> list[Sample]:
        """The samples with `teacher_logprobs`: the teacher's logprob of every trained token (0 elsewhere)."""
        chunks, size = [[]], 0
        for sample in samples:
            if chunks[-1] and size + len(sample.input_ids) > self.config.batch_tokens:
                chunks.append([])
                size = 0
            chunks[-1].append(sample)
            size += len(sample.input_ids)
        scored = await asyncio.gather(*(self._score(chunk) for chunk in chunks if chunk))
        return [sample for chunk in scored for sample in chunk]

    async def _score(self, samples: list[Sample]) -> list[Sample]:
        reply = await self._call("POST", "/v1/completions", json={
            "model": self.model, "prompt": [s.input_ids for s in samples], "max_tokens": 1, "prompt_logprobs": 0,
            "temperature": 1.0})
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != len(samples):
            raise TeacherError(f"the teacher answered {len(choices)} prompts of {len(samples)}")
        return [replace(s, teacher_logprobs=token_logprobs(s, c["prompt_logprobs"])) for s, c in zip(samples, choices)]

    async def _call(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise TeacherError(f"the teacher at {self.config.base_url} did not answer {path}: {e!r}") from e
        if response.status_code != 200:
            raise TeacherError(f"the teacher at {self.config.base_url} refused {path}: {response.status_code} "
                               f"{response.text[:500]}")
        return response.json()

    async def close(self) -> None:
        await self.http.aclose()


def token_logprobs(sample: Sample, prompt_logprobs: list[dict | None]) -> list[float]:
    """Per token, the teacher's logprob of that very token where the sample trains on it, else 0 (as `logprobs`)."""
    if len(prompt_logprobs) != len(sample.input_ids):
        raise TeacherError(f"the teacher scored {len(prompt_logprobs)} tokens of a {len(sample.input_ids)}-token "
                           "sample")
    values = []
    for token, trained, ranked in zip(sample.input_ids, sample.loss_mask, prompt_logprobs):
        if not trained or ranked is None:  # ranked is None only for the first token, which is never trained
            values.append(0.0)
            continue
        entry = ranked.get(str(token))
        if entry is None:
            raise TeacherError(f"the teacher's prompt logprobs lack token {token}: {list(ranked)[:5]}")
        logprob = float(entry["logprob"])
        if not logprob <= 1e-3:  # NaN, or a probability above 1
            raise TeacherError(f"the teacher's logprob of token {token} is {logprob}")
        values.append(max(logprob, MIN_LOGPROB))
    return values
