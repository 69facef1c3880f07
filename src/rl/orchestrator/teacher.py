"""The teacher of on-policy distillation: a frozen model's vLLM server that scores each trained sample's tokens.

Each sample (prompt and completion, as the student sampled it) is sent as a prompt of token ids with
`prompt_logprobs = 0`: vLLM prefills it and returns the teacher's logprob of every token given the ones before it,
at temperature 1 (prompt logprobs are the model's own distribution). Several samples go in one request, up to
`batch_tokens` tokens; the requests of a step run at once. The trainer's loss turns log pi_T - log pi_old into each
token's distillation advantage (trainer/loss.py). With `top_k` > 0 the request asks for `prompt_logprobs = top_k`,
and each trained token also ships the teacher's k likeliest tokens at its position and their logprobs, for the loss's
dense term (`loss.distill_top_k`).

The teacher must tokenize as the student does: at start, probe texts are tokenized by the teacher's server
(`return_token_ids`) and by the student's tokenizer, and any difference refuses the run (`TeacherError`)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace

import httpx

from rl.config import API_KEY_VAR
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
        self.vocab_size: int | None = None  # the student tokenizer's, once started: top-k ids beyond it are refused

    async def start(self, tokenizer, student: str, timeout_s: float) -> None:
        """Wait for the server (at most `timeout_s`), name the served model and refuse a teacher that tokenizes
        otherwise than the student's `tokenizer`."""
        await self._wait_healthy(timeout_s)
        if self.config.top_k:
            self.vocab_size = len(tokenizer)
        if self.model is None:
            listed = [m["id"] for m in (await self._call("GET", "/v1/models"))["data"]]
            if len(listed) != 1:
                raise TeacherError(f"the teacher at {self.config.base_url} serves {listed}: set teacher.model")
            self.model = listed[0]
        for probe in PROBES:  # asking for the top-k too: a server that refuses them (vLLM's max_logprobs) says so now
            reply = await self._call("POST", "/v1/completions", json={
                "model": self.model, "prompt": probe, "max_tokens": 1, "return_token_ids": True,
                **({"prompt_logprobs": self.config.top_k} if self.config.top_k else {})})
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
        """The samples with `teacher_logprobs`: the teacher's logprob of every trained token (0 elsewhere), and with
        `top_k`, its k likeliest tokens at each of them."""
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
        top_k = self.config.top_k
        reply = await self._call("POST", "/v1/completions", json={
            "model": self.model, "prompt": [s.input_ids for s in samples], "max_tokens": 1, "prompt_logprobs": top_k,
            "temperature": 1.0})
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != len(samples):
            raise TeacherError(f"the teacher answered {len(choices)} prompts of {len(samples)}")
        scored = []
        for sample, choice in zip(samples, choices):
            sample = replace(sample, teacher_logprobs=token_logprobs(sample, choice["prompt_logprobs"]))
            if top_k:
                ids, logprobs = top_tokens(sample, choice["prompt_logprobs"], top_k, self.vocab_size)
                sample = replace(sample, teacher_top_ids=ids, teacher_top_logprobs=logprobs)
            scored.append(sample)
        return scored

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


def top_tokens(sample: Sample, prompt_logprobs: list[dict | None], k: int, vocab_size: int | None = None,
               ) -> tuple[list[list[int]], list[list[float]]]:
    """Per token where the sample trains, the teacher's k likeliest tokens there and their logprobs, likeliest first
    (vLLM lists them beside the token itself, which may rank lower); zeros elsewhere. A token id at or past
    `vocab_size` (the student's tokenizer) is refused: the trainer indexes the student's logits with them."""
    ids, logprobs = [], []
    for trained, ranked in zip(sample.loss_mask, prompt_logprobs):  # lengths checked by token_logprobs
        if not trained or ranked is None:
            ids.append([0] * k)
            logprobs.append([0.0] * k)
            continue
        try:
            best = sorted(((float(e["logprob"]), int(token)) for token, e in ranked.items()), reverse=True)[:k]
        except (TypeError, ValueError, KeyError) as e:
            raise TeacherError(f"the teacher's prompt logprobs are malformed: {list(ranked.items())[:3]}") from e
        if len(best) < k or not all(logprob <= 1e-3 for logprob, _ in best):  # NaN fails the comparison too
            raise TeacherError(f"the teacher's prompt logprobs hold {len(best)} valid entries where top_k = {k} "
                               f"asks for {k}: {list(ranked.items())[:3]}")
        if vocab_size is not None and any(not 0 <= token < vocab_size for _, token in best):
            raise TeacherError(f"the teacher ranks token ids {[t for _, t in best]} outside the student's vocabulary "
                               f"of {vocab_size}")
        ids.append([token for _, token in best])
        logprobs.append([max(logprob, MIN_LOGPROB) for logprob, _ in best])
    return ids, logprobs
