"""The teacher of on-policy distillation: a frozen model's vLLM server that scores each trained sample's tokens.

Each sample (prompt and completion, as the student sampled it) is sent as a prompt of token ids with
`prompt_logprobs = 0`: vLLM prefills it and returns the teacher's logprob of every token given the ones before it,
at temperature 1 (prompt logprobs are the model's own distribution). Several samples go in one request, up to
`batch_tokens` tokens; the requests of a step run at once. The trainer's loss turns log pi_T - log pi_old into each
token's distillation advantage (trainer/loss.py). With `top_k` > 0 the request asks for `prompt_logprobs = top_k`,
and each trained token also ships the teacher's k likeliest tokens at its position and their logprobs, for the loss's
dense term (`loss.distill_top_k`).

The teacher must tokenize as the student does: at start, probe texts are tokenized by the teacher's server
(`return_token_ids`) and by the student's tokenizer, and any difference refuses the run (`TeacherError`).

A reply is refused unless it is what vLLM writes: read as it streams up to a bound its size allows (`reply_bound`),
JSON without a key twice in one object, and at every scored position token ids in canonical decimal, at most `top_k`
of them besides the position's own token, finite logprobs (or -inf) whose probabilities sum to at most 1."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from dataclasses import replace

import httpx

from rl.config import API_KEY_VAR
from rl.orchestrator.config import TeacherConfig
from rl.samples import Sample

PROBES = (  # what differs first between tokenizers: words, digits, accents, CJK, emoji, chat-template markers
    "Hello, world! 12345 + 678 = 7023",
    "Größe, façade, naïve; 東京は晴れ。🙂",
    "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "def f(x):\n\treturn x ** 2  # squared\n",
)


MIN_LOGPROB = -50.0  # a token the teacher rules out (-inf) counts as this unlikely: its advantage stays finite
CANONICAL_ID = re.compile(r"0|[1-9][0-9]{0,11}")  # as vLLM writes an id: no sign, leading zero, "_" or other digits
PROBABILITY_SLACK = 1e-3  # float32 log-softmax rounds each probability by ~1e-7; this is the most a position's may
# sum past 1 (the per-token logprob check allows the same 1e-3)
REPLY_BYTES_FIXED = 1 << 20  # a reply's envelope (ids, usage, the one generated token) and a probe's whole reply
REPLY_BYTES_PER_ENTRY = 512  # vLLM writes a ranked entry ('"id": {"logprob", "rank", "decoded_token"}') in ~100 bytes


def reply_bound(tokens: int, top_k: int) -> int:
    """The most bytes a reply that scores `tokens` tokens may take: each token ranks at most top_k + 1 entries (the
    top k and itself)."""
    return REPLY_BYTES_FIXED + tokens * (top_k + 1) * REPLY_BYTES_PER_ENTRY


def tokenizer_mismatch(teacher: str, student: str, probe: str, theirs: list[int], ours: list[int]) -> str:
    return (f"the teacher {teacher!r} tokenizes {probe!r} as {theirs[:12]}... but the student {student!r} as "
            f"{ours[:12]}...: distillation compares the two models token by token, so the teacher must share the "
            "student's tokenizer")


class TeacherError(RuntimeError):
    """The teacher cannot score this run's samples: unreachable, another tokenizer, or a malformed reply."""


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: a JSON object naming a key twice is refused (json keeps the last one silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        twice = next(key for i, (key, _) in enumerate(pairs) if key in dict(pairs[:i]))
        raise TeacherError(f"the teacher's reply names key {twice!r} twice in one object")
    return obj


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
            listed = [m["id"] for m in (await self._call("GET", "/v1/models", REPLY_BYTES_FIXED))["data"]]
            if len(listed) != 1:
                raise TeacherError(f"the teacher at {self.config.base_url} serves {listed}: set teacher.model")
            self.model = listed[0]
        for probe in PROBES:  # asking for the top-k too: a server that refuses them (vLLM's max_logprobs) says so now
            reply = await self._call("POST", "/v1/completions", REPLY_BYTES_FIXED, json={
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
        tokens = sum(len(s.input_ids) for s in samples)
        bound = (f"its bound for {tokens} tokens at top_k = {top_k} ({REPLY_BYTES_PER_ENTRY} bytes a ranked entry, "
                 f"{REPLY_BYTES_FIXED} more)")
        reply = await self._call("POST", "/v1/completions", reply_bound(tokens, top_k), what=bound, json={
            "model": self.model, "prompt": [s.input_ids for s in samples], "max_tokens": 1, "prompt_logprobs": top_k,
            "temperature": 1.0})
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != len(samples):
            raise TeacherError(f"the teacher answered {len(choices)} prompts of {len(samples)}")
        scored = []
        for sample, choice in zip(samples, choices):
            sample = replace(sample, teacher_logprobs=token_logprobs(sample, choice["prompt_logprobs"], top_k,
                                                                     self.vocab_size))
            if top_k:
                ids, logprobs = top_tokens(sample, choice["prompt_logprobs"], top_k, self.vocab_size)
                sample = replace(sample, teacher_top_ids=ids, teacher_top_logprobs=logprobs)
            scored.append(sample)
        return scored

    async def _call(self, method: str, path: str, bound: int, what: str = "its bound", **kwargs) -> dict:
        """The JSON reply to one request, read as it streams and refused past `bound` bytes."""
        try:
            async with self.http.stream(method, path, **kwargs) as response:
                body = await read_bounded(response, bound, f"the teacher's reply to {path}", what)
        except httpx.HTTPError as e:
            raise TeacherError(f"the teacher at {self.config.base_url} did not answer {path}: {e!r}") from e
        if response.status_code != 200:
            raise TeacherError(f"the teacher at {self.config.base_url} refused {path}: {response.status_code} "
                               f"{body[:500].decode(errors='replace')}")
        try:
            return json.loads(body, object_pairs_hook=unique_keys)
        except ValueError as e:
            raise TeacherError(f"the teacher's reply to {path} is not JSON: {e}") from e

    async def close(self) -> None:
        await self.http.aclose()


async def read_bounded(response: httpx.Response, bound: int, where: str, what: str) -> bytes:
    """The body of `response`, read as it comes; past `bound` bytes (announced or received) it is refused."""
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > bound:
        raise TeacherError(f"{where} announces {int(length)} bytes, past {bound} bytes, {what}")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > bound:
            raise TeacherError(f"{where} passed {bound} bytes, {what}: refused unread")
    return bytes(body)


def ranked_entries(token: int, ranked: dict, k: int, vocab_size: int | None) -> list[tuple[float, int]]:
    """One position's prompt logprobs as (logprob, id), checked: ids in canonical decimal (so distinct, since a JSON
    object names a key once), below `vocab_size` when known, at most `k` besides `token` (the position's own, which
    vLLM adds when it ranks lower), numeric logprobs at most 1e-3 (-inf allowed, NaN not) and probabilities summing
    to at most 1 + PROBABILITY_SLACK."""
    if not isinstance(ranked, dict):
        raise TeacherError(f"the teacher's prompt logprobs at a position are {type(ranked).__name__}, not an object")
    besides = len(ranked) - (str(token) in ranked)
    if besides > k:
        raise TeacherError(f"the teacher ranks {besides} tokens besides token {token} where top_k = {k}: at most {k}")
    entries = []
    for key, entry in ranked.items():
        if not CANONICAL_ID.fullmatch(key):
            raise TeacherError(f"the teacher names token id {key!r}: ids are written in canonical decimal (no sign, "
                               "leading zero, separator or non-ASCII digit)")
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if isinstance(logprob, bool) or not isinstance(logprob, int | float) or not logprob <= 1e-3:
            raise TeacherError(f"the teacher's prompt logprobs hold invalid entries: the logprob of token {key} is "
                               f"{logprob!r}")
        entries.append((float(logprob), int(key)))
    if vocab_size is not None and any(not 0 <= token < vocab_size for _, token in entries):
        raise TeacherError(f"the teacher ranks token ids {[t for _, t in entries]} outside the student's vocabulary "
                           f"of {vocab_size}")
    total = math.fsum(math.exp(min(logprob, 0.0)) for logprob, _ in entries)
    if total > 1 + PROBABILITY_SLACK:
        raise TeacherError(f"the teacher's probabilities at one position sum to {total} > 1 (+ {PROBABILITY_SLACK} "
                           f"for rounding): {list(ranked.items())[:3]}")
    return entries


def token_logprobs(sample: Sample, prompt_logprobs: list[dict | None], k: int = 0, vocab_size: int | None = None,
                   ) -> list[float]:
    """Per token, the teacher's logprob of that very token where the sample trains on it, else 0 (as `logprobs`).
    Every position's ranking is checked (`ranked_entries`), trained or not."""
    if len(prompt_logprobs) != len(sample.input_ids):
        raise TeacherError(f"the teacher scored {len(prompt_logprobs)} tokens of a {len(sample.input_ids)}-token "
                           "sample")
    values = []
    for token, trained, ranked in zip(sample.input_ids, sample.loss_mask, prompt_logprobs):
        if ranked is not None:  # None only for the first token, which is never trained
            ranked_entries(token, ranked, k, vocab_size)
        if not trained or ranked is None:
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
    for token, trained, ranked in zip(sample.input_ids, sample.loss_mask, prompt_logprobs):  # lengths: token_logprobs
        if not trained or ranked is None:
            ids.append([0] * k)
            logprobs.append([0.0] * k)
            continue
        best = sorted(ranked_entries(token, ranked, k, vocab_size), reverse=True)[:k]
        if len(best) < k:
            raise TeacherError(f"the teacher's prompt logprobs hold {len(best)} valid entries where top_k = {k} "
                               f"asks for {k}: {list(ranked.items())[:3]}")
        ids.append([token for _, token in best])
        logprobs.append([max(logprob, MIN_LOGPROB) for logprob, _ in best])
    return ids, logprobs
