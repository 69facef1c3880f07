"""Run groups of rollouts of a verifiers environment and return token-level results.

verifiers does the rollout: its training client (`TrainClientConfig`) renders the prompt with the
model's chat template, calls vLLM's `/inference/v1/generate`, and records token ids, the sampled-token
mask and the sampling logprobs on the trace; the task scores the trace. Evaluation may instead sample
through verifiers' chat client (`EvalClientConfig`, `ChatClient` here): plain OpenAI chat completions,
which any OpenAI-compatible server answers, with text and no tokens. This module only runs `n`
episodes of one task of a loaded environment (`environment.py`), and flattens each episode's trace into
a plain `RolloutResult`. Task order is the environment's own and indexable, so the orchestrator owns the
sampler position (and can resume it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field
from urllib.parse import urlparse
from collections.abc import Callable, Coroutine
from typing import Any

import verifiers.v1 as vf

from rl.config import API_KEY_VAR
from rl.envs.chat_calls import tool_messages
from rl.envs.chat_replies import MAX_REPLY_BYTES, BoundedChatConfig
from rl.envs.config import GROUP_GAP_S
from rl.envs.engine_client import GroupedTrainClientConfig
from rl.envs.loading import Environment
from rl.envs.policy_versions import POLICY_VERSION_STREAM, token_versions
from rl.envs.slots import RolloutSlots


@dataclass(frozen=True)
class InferenceClient:
    """Where rollouts sample from: rl's inference server, token ids in and out (what training needs)."""

    base_url: str  # OpenAI-compatible server root, with or without /v1
    model: str  # the name the server serves the policy under
    tokenizer: str  # local model/tokenizer directory the prompt is rendered with
    renderer: Any  # a typed renderers config (rl/renderer.py picks it per model)
    api_key_var: str = API_KEY_VAR
    group_gap_s: float = GROUP_GAP_S  # a group's identical requests go as one with n samples (engine_client.py)

    def client_config(self, group_size: int = 1) -> GroupedTrainClientConfig:
        base_url = self.base_url.rstrip("/")
        return GroupedTrainClientConfig(
            # renderers finds /inference/v1/generate beside /v1 and reads max_model_len from /v1/models.
            base_url=base_url if base_url.endswith("/v1") else f"{base_url}/v1",
            api_key_var=self.api_key_var,
            renderer=self.renderer,
            renderer_model_name=self.tokenizer,
            group_size=group_size,
            group_gap_s=self.group_gap_s,
        )


@dataclass(frozen=True)
class ChatClient:
    """Any OpenAI-compatible server (vLLM, a hosted API) through chat completions: the server renders the chat and
    parses the reply, so results have text and no token ids (evaluation only)."""

    base_url: str  # the API root (https://api.openai.com/v1), or a server root, which gets /v1
    model: str
    api_key_var: str = API_KEY_VAR
    max_reply_bytes: int = MAX_REPLY_BYTES  # a reply past this is refused as it streams (envs/chat_replies.py)
    reply_deadline_s: float | None = None  # each reply is read whole within this of its request, or refused

    def client_config(self, group_size: int = 1) -> BoundedChatConfig:  # one sample per chat request: no groups
        return BoundedChatConfig(base_url=openai_api_root(self.base_url), api_key_var=self.api_key_var,
                                 max_reply_bytes=self.max_reply_bytes, deadline_s=self.reply_deadline_s)


def openai_api_root(url: str) -> str:
    """The URL as given where it has a path (`.../v1`, a provider's `.../openai`), else `<url>/v1`: a bare host is a
    vLLM server's root."""
    url = url.rstrip("/")
    return url if urlparse(url).path else f"{url}/v1"


@dataclass(frozen=True)
class Sampling:
    """Sampling settings sent to vLLM; rollout j of a group gets seed + j, so a group is not n copies."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other vLLM sampling params (top_k, min_p ...)
    priority: int | None = None  # vLLM's request priority (lower first): the group's number under continuous dispatch


@dataclass
class TokenSegment:
    """One trainable stretch of a rollout; completion_* lists are aligned token by token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]  # 1 = sampled by the policy, 0 = inserted by the environment
    completion_logprobs: list[float]  # sampling logprobs; 0.0 where completion_mask is 0
    # the policy version (step) that sampled each token; None where unknown: a token not sampled (completion_mask 0),
    # or one vLLM gave no step label (rl/envs/policy_versions.py)
    completion_versions: list[int | None] = field(default_factory=list)
    # an MoE's routed experts of every token, prompt and completion: [tokens, layers, top_k] (verifiers' branch
    # rows, from vLLM's generate replies); None where the server recorded none
    routed_experts: Any = None
    images: list[str] = field(default_factory=list)  # the image URLs of its messages, in order (a vision model's)


@dataclass
class ChatText:
    """A chat rollout's conversation: the prompt messages and the messages from the first sampled reply on."""

    prompt: list[dict]
    completion: list[dict]
    completion_tokens: int  # as the server reported them (0 where it reports no usage)


@dataclass
class RolloutResult:
    """One rollout as the trainer needs it.

    A multi-turn rollout is one segment while every turn's prompt extends the tokens before it (the
    environment's turns then sit in the completion, masked). When a re-rendered conversation does not
    extend the sampled tokens (verifiers then opens a new branch of the trace), each branch is its own
    segment, and each becomes its own sample with the rollout's advantage."""

    task_index: int
    task_id: str  # the task's durable id, else its content hash
    segments: list[TokenSegment]  # none for a chat rollout (ChatClient): it has no token ids
    reward: float  # sum of weight * score over `rewards`
    rewards: dict[str, float]  # reward components, unweighted scores
    metrics: dict[str, float]
    is_truncated: bool  # stopped by max_tokens or a turn/token limit
    num_turns: int
    tool_calls: int | None = None  # tool results the model got back; None where no tools were offered
    tool_errors: int | None = None  # of those, the calls that failed (`error: ...` results)
    chat: ChatText | None = None  # a chat rollout's text, in place of segments

    @property
    def sampled_tokens(self) -> int:
        if self.chat is not None:
            return self.chat.completion_tokens
        return sum(sum(segment.completion_mask) for segment in self.segments)


class RolloutError(RuntimeError):
    """A rollout failed (inference unreachable, harness or scoring error): no sample to train on."""


async def run_group(
    environment: Environment,
    task_index: int,
    n: int,
    client: InferenceClient | ChatClient,
    sampling: Sampling,
    slots: RolloutSlots | None = None,
    timeout_s: float | None = None,
) -> list[RolloutResult]:
    """Run `n` rollouts of task `task_index` concurrently, once `slots` has room for them.

    They must finish within `timeout_s` of getting their slots, else RolloutError. The environment's runner
    (rl/envs/runner.py) says where they run, and whether the group takes its slots and deadline as one."""
    task = environment.task(task_index)
    contexts = model_contexts(client, sampling, n)

    def bound(run: Coroutine[Any, Any, Any], k: int) -> Coroutine[Any, Any, Any]:
        return bounded(task_index, run, k, slots, timeout_s)

    episodes = await environment.runner.run_group(environment.env, task, contexts, bound)
    convert = to_chat_result if isinstance(client, ChatClient) else to_result
    return [convert(task_index, task, episode) for episode in episodes]


async def bounded(task_index: int, run: Coroutine[Any, Any, Any], n: int, slots: RolloutSlots | None,
                  timeout_s: float | None) -> Any:
    """`run`, of `n` rollouts; the deadline starts once it holds their slots, so queueing does not count. A served
    group cancelled at its deadline is cancelled on its server too."""
    async with slots.take(n) if slots else contextlib.nullcontext():
        try:
            return await asyncio.wait_for(run, timeout_s)
        except TimeoutError as e:
            what = "rollout" if n == 1 else f"group of {n} rollouts"
            raise RolloutError(f"{what} of task {task_index} timed out after {timeout_s}s") from e


@dataclass
class GroupOutcome:
    """A group after its attempts: its results, or None and why it was dropped."""

    env: Environment
    results: list[RolloutResult] | None
    error: str | None = None  # the last attempt's error type, where the group was dropped
    message: str = ""  # and its text
    retries: int = 0
    policy_step: int = 0  # training: the policy served as the group started
    server: int = 0  # training: the index of the server it ran on
    task_index: int = 0  # the task it ran
    unscored: int = 0  # rollouts left out: a reward (or component) not a finite float32 (`finite_rewards`)


async def run_group_retried(
    environment: Environment,
    task_index: int,
    n: int,
    client: InferenceClient | ChatClient,
    sampling: Sampling,
    slots: RolloutSlots | None,
    timeout_s: float | None,
    max_retries: int,
    log: Callable[[str], None],
    *, server: int = 0, policy_step: int = 0,  # training's labels
) -> GroupOutcome:
    """run_group, run again up to `max_retries` times after a failure (logged), then dropped with its error. Training
    labels the outcome with the server it ran on and the policy served as it started (`server`, `policy_step`)."""
    error: Exception | None = None
    made = dict(server=server, policy_step=policy_step, task_index=task_index)
    for attempt in range(max_retries + 1):
        try:
            results = await run_group(environment, task_index, n, client, sampling, slots, timeout_s)
            scored = [r for r in results if finite_rewards(r)]
            if len(scored) < len(results):  # a reward function that divided by zero, a judge that answered NaN
                why = f"{len(results) - len(scored)} of {n} rollouts of task {task_index} of {environment.name} " \
                      f"have a reward that is not a finite float32: {unscored_rewards(results)}"
                log(f"{why}; they are left out as failed rollouts")
                if not scored:
                    return GroupOutcome(environment, None, "RewardNotFinite", why, retries=attempt, **made)
            return GroupOutcome(environment, scored, retries=attempt, unscored=len(results) - len(scored), **made)
        except Exception as e:  # noqa: BLE001 - retried, then dropped and counted by reason, never silently
            log(f"group of task {task_index} of {environment.name} failed (attempt {attempt + 1}): {e!r}")
            error = e
    return GroupOutcome(environment, None, type(error).__name__, str(error), retries=max_retries, **made)


FLOAT32_MAX = 3.4028234663852886e38


def finite_float32(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= FLOAT32_MAX


def finite_rewards(result: RolloutResult) -> bool:
    """Whether the rollout's reward and every component are finite and within float32 (the batch's dtype)."""
    return all(finite_float32(v) for v in (result.reward, *result.rewards.values()))


def unscored_rewards(results: list[RolloutResult]) -> str:
    """The first bad rewards, for the log: `reward=nan`, `correct=inf`."""
    bad = [f"{name}={value!r}" for r in results for name, value in (("reward", r.reward), *r.rewards.items())
           if not finite_float32(value)]
    return ", ".join(bad[:4])


def model_contexts(client: InferenceClient | ChatClient, sampling: Sampling, n: int) -> list[vf.ModelContext]:
    """verifiers' model contexts for a group's n rollouts: the client's verifiers config, and each rollout's
    sampling. The configs are built once per group and shared (verifiers copies what it changes; validating them
    per rollout was ~1% of the orchestrator's CPU); only seeded rollouts get sampling settings of their own."""
    config = client.client_config(n)
    if sampling.seed is None:
        settings = [sampling_config(client, sampling, None)] * n
    else:
        settings = [sampling_config(client, sampling, sampling.seed + j) for j in range(n)]
    return [vf.ModelContext(model=client.model, client=config, sampling=each) for each in settings]


def sampling_config(client: InferenceClient | ChatClient, sampling: Sampling, seed: int | None) -> vf.SamplingConfig:
    return vf.SamplingConfig(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        **({"seed": seed} if seed is not None else {}),
        **({"priority": sampling.priority} if sampling.priority is not None else {}),
        **({"detokenize": False} if tokens_only(client, sampling) else {}),
        **sampling.extra,
    )


def tokens_only(client: InferenceClient | ChatClient, sampling: Sampling) -> bool:
    """Whether vLLM may skip detokenizing: the training client sends and reads token ids, and its renderer parses
    the completion from them, so vLLM's text and its logprobs' token strings go unread; making them cost the API
    server's CPU on every token (benchmarks/RESULTS.md). Stop strings are matched on text."""
    return isinstance(client, InferenceClient) and "stop" not in sampling.extra


def scored_trace(task_index: int, episode: vf.Episode) -> vf.Trace:
    """The episode's one trace, where it finished and was scored; else RolloutError says why not."""
    trace = episode.traces[0] if len(episode.traces) == 1 else None
    if not episode.ok or trace is None:
        error = (trace.last_error if trace else None) or episode.last_error
        detail = f"{error.type}: {error.message}" if error else f"{len(episode.traces)} traces"
        raise RolloutError(f"rollout of task {task_index} failed: {detail}")
    if any(score is None for score in trace.rewards.values()):
        raise RolloutError(f"rollout of task {task_index} was not scored: {trace.rewards}")
    return trace


def to_result(task_index: int, task: vf.Task, episode: vf.Episode) -> RolloutResult:
    """Flatten a single-trace episode; each trainable branch of the trace is one segment."""
    trace = scored_trace(task_index, episode)
    branches = [branch for branch in trace.branches if branch.trainable]
    if not branches:
        raise RolloutError(f"rollout of task {task_index} has no trainable branch")
    return RolloutResult(
        task_index=task_index,
        task_id=task.data.id or task.key,
        segments=to_segments(task_index, branches),
        **outcome(trace),
    )


def to_chat_result(task_index: int, task: vf.Task, episode: vf.Episode) -> RolloutResult:
    """A chat rollout: its scores and its final conversation, split where the model's first reply starts."""
    trace = scored_trace(task_index, episode)
    nodes = trace.branches[-1].nodes if trace.nodes else []
    first_reply = next((i for i, node in enumerate(nodes) if node.sampled), None)
    if first_reply is None:
        raise RolloutError(f"rollout of task {task_index} got no reply from the model")
    messages = [node.message.model_dump(mode="json", exclude_none=True) for node in nodes]
    usage = trace.usage
    chat = ChatText(messages[:first_reply], messages[first_reply:], usage.completion_tokens if usage else 0)
    return RolloutResult(task_index=task_index, task_id=task.data.id or task.key, segments=[], chat=chat,
                         **outcome(trace))


def outcome(trace: vf.Trace) -> dict[str, Any]:
    """The RolloutResult fields every client's trace gives alike."""
    return dict(
        reward=trace.reward,
        rewards={name: score.score for name, score in trace.rewards.items()},
        metrics={name: value for name, value in trace.metrics.items() if value is not None},
        is_truncated=trace.is_truncated,
        num_turns=trace.num_turns,
        **tool_counts(trace),
    )


def tool_counts(trace: vf.Trace) -> dict[str, int]:
    """How many tool calls ran and failed, read off the conversation (any harness's tool messages); nothing
    where the rollout was offered no tools."""
    if not trace.tools:
        return {}
    results = tool_messages(trace.messages)
    return {"tool_calls": len(results), "tool_errors": sum(r.startswith("error") for r in results)}


def to_segments(task_index: int, branches: list) -> list[TokenSegment]:
    """One segment per branch. Branches are root-to-leaf paths that share nodes: a sampled node is
    trained in the first branch that holds it and is context (masked) in the later ones."""
    trained: set[int] = set()
    segments = []
    for branch in branches:
        ids, mask, logprobs = branch.token_ids, list(branch.sampled_mask), list(branch.logprobs)
        versions: list[int | None] = []
        position = 0
        for node in branch.nodes:
            end = position + len(node.token_ids)
            if id(node) in trained:
                mask[position:end] = [False] * (end - position)
                logprobs[position:end] = [0.0] * (end - position)
            elif any(node.mask):
                trained.add(id(node))
            versions.extend(node_versions(node))
            position = end
        if True in mask:
            versions = [v if m else None for v, m in zip(versions, mask, strict=True)]
            segments.append(to_segment(ids, mask, logprobs, versions, branch.routed_experts, branch_images(branch)))
    if not segments:
        raise RolloutError(f"rollout of task {task_index} sampled no token")
    return segments


def node_versions(node: vf.MessageNode) -> list[int | None]:
    """The policy version of each of a node's tokens, as its turn's commit stamped them; None for all where it
    did not (rl/patches/token_versions.py)."""
    stream = (node.loss_weights or {}).get(POLICY_VERSION_STREAM)
    if stream is None or len(stream) != len(node.token_ids):
        return [None] * len(node.token_ids)
    return token_versions(stream)


def branch_images(branch) -> list[str]:
    """The image URLs of a branch's messages, in the order their placeholder runs take in its tokens."""
    return [part.image_url.url for message in branch.messages if isinstance(message.content, list)
            for part in message.content if getattr(part, "type", None) == "image_url"]


def to_segment(ids: list[int], mask: list[bool], logprobs: list[float], versions: list[int | None],
               routed_experts=None, images: list[str] | None = None) -> TokenSegment:
    """The prompt of a segment ends where its first trained token starts."""
    start = mask.index(True)
    return TokenSegment(
        prompt_ids=ids[:start],
        completion_ids=ids[start:],
        completion_mask=[int(m) for m in mask[start:]],
        completion_logprobs=logprobs[start:],
        completion_versions=versions[start:],
        routed_experts=routed_experts if routed_experts is not None and len(routed_experts) == len(ids) else None,
        images=images or [],
    )
