"""Which policy version sampled each token of a turn.

vLLM labels what it samples with the weight version the server last set (`update_weight_version`: rl's inference
server sets the step of every verified load, "0" for the base model) and answers each choice of a generate request
with spans over its output tokens, `"weight_versions": [{"version": "0", "start": 0, "end": 17},
{"version": "1", "start": 17, "end": 40}]`: a request that spans a weight update has tokens of two policies.
verifiers' training client drops the field (renderers parses the reply into a dict without it). So rl's transport
(`EngineClient`, rl/envs/engine_client.py) records each generate reply's spans here, under the rollout's session id
(verifiers' `SESSION_ID_HEADER`: the trace's id), and verifiers' turn commit, patched (rl/patches/token_versions.py),
takes them back when it makes the turn's sampled node, by trace id and completion tokens, and stamps the node with
the stream `POLICY_VERSION_STREAM` (`node_versions`). `to_segments` (rl/envs/rollouts.py) reads it back per token.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

POLICY_VERSION_STREAM = "rl.policy_version"
"""The loss-weight stream of a sampled node (verifiers' `MessageNode.loss_weights`) that holds, per token of its
`token_ids`, the policy version that sampled it (the scaffold before the completion takes the first token's;
`UNKNOWN` where vLLM's label was not a step). It rides `loss_weights` because that is the one per-token field
verifiers leaves to its consumers ("named loss-weight streams aligned to token_ids, consumer-stamped"), serializes
with the node (so it crosses the env-server wire with the trace) and reads nowhere itself; rl's trainer does not
weight its loss with it."""
UNKNOWN = -1.0  # a token of the stream whose version vLLM did not label with a step
ROLLOUTS_REMEMBERED = 65_536  # rollouts with replies not yet taken: more than are ever in flight at once
REPLIES_PER_SESSION = 16  # one rollout's replies not yet taken (its parallel turns)

Spans = tuple[tuple[int | None, int, int], ...]  # (version, first token, end): versions of output tokens [start, end)


class WeightVersionSpan(msgspec.Struct):
    version: str
    start: int
    end: int


class VersionedChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class VersionedReply(msgspec.Struct):
    """What rl reads of vLLM's generate reply: its choices' tokens and weight-version spans (msgspec skips the rest)."""

    choices: list[VersionedChoice] = []


def version_of(label: str) -> int | None:
    """A weight-version label as a policy step: a base-10 integer; anything else ("default", vLLM's label before
    any was set) is unknown."""
    return int(label) if label.isascii() and label.isdigit() else None


class SampledVersions:
    """The version spans of generate replies, per rollout (session id), until its turn takes them: each under its
    completion tokens, so a rollout's parallel turns each take their own. Bounded: replies never taken (a turn
    that failed after its reply came) give way to newer ones, the least recently recorded rollout first."""

    def __init__(self, sessions: int = ROLLOUTS_REMEMBERED, per_session: int = REPLIES_PER_SESSION) -> None:
        self.sessions, self.per_session = sessions, per_session
        self.replies: OrderedDict[str, dict[int, Spans]] = OrderedDict()

    def record(self, session: str, content: bytes) -> None:
        """Remember the spans of the first choice of a generate reply (the one a training client reads); a reply
        without spans (vLLM reported no label) or not vLLM's is passed over."""
        try:
            choices = msgspec.json.decode(content, type=VersionedReply).choices
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        choice = choices[0] if choices else None
        if choice is None or choice.token_ids is None or choice.weight_versions is None:
            return
        spans = tuple((version_of(s.version), s.start, s.end) for s in choice.weight_versions)
        replies = self.replies.setdefault(session, {})
        self.replies.move_to_end(session)
        replies[completion_key(choice.token_ids)] = spans
        if len(replies) > self.per_session:
            del replies[next(iter(replies))]
        if len(self.replies) > self.sessions:
            self.replies.popitem(last=False)

    def take(self, session: str, completion_ids: list[int]) -> Spans | None:
        """The spans of the rollout's reply that sampled `completion_ids`, forgotten here; None if none was
        recorded."""
        replies = self.replies.get(session)
        if replies is None:
            return None
        spans = replies.pop(completion_key(completion_ids), None)
        if not replies:
            del self.replies[session]
        return spans

    def node_versions(self, session: str, token_ids: list[int], mask: list[bool]) -> list[float] | None:
        """The stream `POLICY_VERSION_STREAM` of a sampled node of the rollout `session` (its `token_ids`: the
        generation-prompt scaffold, then the completion where `mask` is True), or None (unknown: no reply recorded,
        or spans that are not exactly the completion's tokens in order)."""
        if len(token_ids) != len(mask):
            return None
        completion = [token for token, sampled in zip(token_ids, mask) if sampled]
        spans = self.take(session, completion)
        return None if spans is None else stream_of(spans, mask)


def completion_key(token_ids: list[int]) -> int:
    return hash((len(token_ids), *token_ids))


def stream_of(spans: Spans, mask: list[bool]) -> list[float] | None:
    """Per token of a node, the version of `spans` (over its sampled tokens, in order) that sampled it; the
    scaffold before them takes the first span's version; None unless the spans cover exactly the sampled tokens,
    which must follow the scaffold."""
    sampled = sum(mask)
    scaffold = len(mask) - sampled
    if not spans or not all(mask[scaffold:]):
        return None
    position = 0
    versions: list[float] = []
    for version, start, end in spans:
        if start != position or end <= start:
            return None
        versions.extend([UNKNOWN if version is None else float(version)] * (end - start))
        position = end
    if position != sampled:
        return None
    return versions[:1] * scaffold + versions


def token_versions(stream: list[float] | None) -> list[int | None]:
    """A node's stream back as versions per token, None where unknown."""
    return [None if v == UNKNOWN else int(v) for v in stream] if stream is not None else []


POLICY_VERSIONS = SampledVersions()
"""The process's registry: EngineClient records in it, verifiers' patched turn commit takes from it."""
