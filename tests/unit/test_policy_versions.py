"""Which policy version sampled each token: vLLM's weight-version spans recorded by EngineClient per rollout, stamped
on the sampled node by verifiers' patched turn commit, read back per token by to_segments."""

import asyncio
import json

import httpx
import pytest
import verifiers.v1 as vf
from aiohttp import web
from verifiers.v1.graph import prepare_turn
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import AssistantMessage, Response, TurnTokens, UserMessage

from rl.config import API_KEY_VAR
from rl.envs.config import EnvConfig
from rl.envs.engine_client import EngineClient, GroupedTrainClientConfig
from rl.envs.loading import load_environment
from rl.envs.policy_versions import (
    POLICY_VERSION_STREAM, POLICY_VERSIONS, UNKNOWN, SampledVersions, stream_of, version_of,
)
from rl.envs.rollouts import InferenceClient, Sampling, run_group, to_segments
from rl.renderer import renderer_config

SESSION = "X-Session-ID"


def reply(choices: list[tuple[list[int], list[dict] | None]]) -> bytes:
    """vLLM's generate reply: per choice its tokens and `weight_versions` (None: the field absent)."""
    def entry(token: int) -> dict:
        return {"token_id": token, "logprob": -0.25, "token": f"token_id:{token}"}

    out = []
    for i, (tokens, spans) in enumerate(choices):
        choice = {"index": i, "token_ids": tokens, "finish_reason": "length",
                  "logprobs": {"content": [entry(t) for t in tokens]}}
        out.append(choice | ({"weight_versions": spans} if spans is not None else {}))
    return json.dumps({"request_id": "gen-1", "choices": out,
                       "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}).encode()


def spans(*versions: tuple[str, int, int]) -> list[dict]:
    return [{"version": v, "start": s, "end": e} for v, s, e in versions]


def test_a_label_is_a_step_only_when_it_is_a_base_10_integer():
    assert [version_of(label) for label in ("0", "17", "default", "", "-1", "1.0", "٣")] == [
        0, 17, None, None, None, None, None]


def test_spans_give_each_token_its_version_and_nothing_unless_they_cover_exactly_the_sampled_tokens():
    mask = [False, False, True, True, True]
    assert stream_of(((0, 0, 1), (1, 1, 3)), mask) == [0.0, 0.0, 0.0, 1.0, 1.0]  # the scaffold takes the first
    assert stream_of(((None, 0, 3),), mask) == [UNKNOWN] * 5
    for wrong in [((0, 0, 2),), ((0, 0, 4),), ((0, 1, 3),), ((0, 0, 1), (1, 2, 3)), ((0, 0, 0), (1, 0, 3)), ()]:
        assert stream_of(wrong, mask) is None, wrong
    assert stream_of(((0, 0, 2),), [False, True, False, True]) is None  # sampled tokens must follow the scaffold


def test_the_registry_hands_each_turn_its_own_reply_once_and_stays_bounded():
    registry = SampledVersions(sessions=2, per_session=2)
    registry.record("a", reply([([5, 6], spans(("0", 0, 1), ("1", 1, 2)))]))
    registry.record("a", reply([([7], spans(("1", 0, 1)))]))  # a parallel turn of the same rollout
    registry.record("a", reply([([8], None)]))  # no labels reported: nothing recorded
    registry.record("a", b"not json")
    assert registry.take("a", [7]) == ((1, 0, 1),)
    assert registry.take("a", [7]) is None  # taken once
    assert registry.node_versions("a", [1, 5, 6], [False, True, True]) == [0.0, 0.0, 1.0]
    assert registry.replies == {}
    for session in "bcd":
        registry.record(session, reply([([5], spans(("2", 0, 1)))]))
    assert list(registry.replies) == ["c", "d"]  # the least recently recorded rollout gave way
    for tokens in ([1], [2], [3]):
        registry.record("d", reply([(tokens, spans(("2", 0, 1)))]))
    assert registry.take("d", [5]) is None and registry.take("d", [3]) == ((2, 0, 1),)


async def generate_engine(answer) -> web.AppRunner:
    """/inference/v1/generate answering `answer(body)`, /v1/models."""
    async def generate(request: web.Request) -> web.Response:
        return web.Response(body=answer(await request.json()), content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 512}]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


BODY = {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "logprobs": 1}}


@pytest.mark.parametrize("group_size", [1, 2])
def test_the_engine_client_records_each_callers_choice_per_rollout(group_size, monkeypatch):
    """Alone, and as a group's request with n = 2 split into each caller's choice."""
    monkeypatch.setenv(API_KEY_VAR, "k1")

    def answer(body: dict) -> bytes:
        n = body["sampling_params"].get("n", 1)
        return reply([([10 + i, 20 + i, 30 + i], spans(("3", 0, 1 + i), (str(4 + i), 1 + i, 3))) for i in range(n)])

    async def scenario():
        runner = await generate_engine(answer)
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = EngineClient(GroupedTrainClientConfig(base_url=f"{url}/v1", api_key_var=API_KEY_VAR,
                                                       group_size=group_size, group_gap_s=0.05))
        try:
            return await asyncio.gather(*(
                client.post(f"{url}/inference/v1/generate", cast_to=httpx.Response, body=BODY,
                            options={"headers": {SESSION: f"rollout-{group_size}-{i}"}})
                for i in range(2)))
        finally:
            await client.close()
            await runner.cleanup()

    replies = [json.loads(r.content)["choices"][0]["token_ids"] for r in asyncio.run(scenario())]
    assert len({tuple(r) for r in replies}) == group_size  # grouped: each caller its own choice
    for i, tokens in enumerate(replies):
        k = tokens[0] - 10
        assert POLICY_VERSIONS.take(f"rollout-{group_size}-{i}", tokens) == ((3, 0, 1 + k), (4 + k, 1 + k, 3))


def new_trace(trace_id: str, **fields) -> vf.Trace:
    return vf.Trace(id=trace_id, task=TraceTask(type="Task", data={}), agent=AgentInfo(config={}), **fields)


def committed_turn(trace_id: str, recorded: bytes | None, completion: list[int]) -> tuple[vf.Trace, vf.MessageNode]:
    """A real verifiers trace's first turn, committed (prompt [1, 2, 3], generation-prompt scaffold [4, 5])
    after EngineClient recorded `recorded` for its rollout."""
    trace = new_trace(trace_id)
    turn = prepare_turn(trace, [UserMessage(content="hi")])
    if recorded is not None:
        POLICY_VERSIONS.record(trace_id, recorded)
    tokens = TurnTokens(prompt_ids=[1, 2, 3, 4, 5], completion_ids=completion,
                        completion_logprobs=[-0.5] * len(completion), message_spans=[(0, 3)])
    response = Response(id="r", created=0, model="m", message=AssistantMessage(content="ok"), finish_reason="stop",
                        tokens=tokens)
    node = trace.nodes[turn.commit(response)]
    assert node.sampled and node.token_ids == [4, 5, *completion] and node.mask == [False] * 2 + [True] * 3
    return trace, node


def test_the_turn_commit_stamps_the_sampled_node_with_the_version_of_each_token():
    _, node = committed_turn("t-stamped", reply([([7, 8, 9], spans(("0", 0, 2), ("1", 2, 3)))]), [7, 8, 9])
    assert node.loss_weights == {POLICY_VERSION_STREAM: [0.0, 0.0, 0.0, 0.0, 1.0]}
    # it rides the node as verifiers serializes it (an env server sends traces so)
    assert vf.MessageNode.model_validate(node.model_dump(mode="json")).loss_weights == node.loss_weights
    assert POLICY_VERSIONS.replies.get("t-stamped") is None  # taken


@pytest.mark.parametrize("recorded", [
    reply([([7, 8, 9], spans(("0", 0, 2)))]),  # spans short of the completion
    reply([([7, 8, 9], spans(("0", 0, 4)))]),  # past it
    reply([([7, 8, 6], spans(("0", 0, 3)))]),  # another turn's reply
    None,  # nothing recorded (a chat client, or a server that labelled nothing)
])
def test_a_turn_whose_spans_do_not_fit_its_completion_is_stamped_with_nothing(recorded):
    trace, node = committed_turn("t-unknown", recorded, [7, 8, 9])
    assert node.loss_weights is None
    assert to_segments(0, trace.branches)[0].completion_versions == [None] * 3


def test_to_segments_carries_each_sampled_tokens_version_and_none_elsewhere():
    trace = new_trace("t-segments")
    first = prepare_turn(trace, [UserMessage(content="hi")])
    POLICY_VERSIONS.record(trace.id, reply([([7, 8], spans(("2", 0, 1), ("3", 1, 2)))]))
    first.commit(Response(id="r", created=0, model="m", message=AssistantMessage(content="a"), finish_reason="stop",
                          tokens=TurnTokens(prompt_ids=[1, 2, 3, 4], completion_ids=[7, 8],
                                            completion_logprobs=[-0.5, -0.5], message_spans=[(0, 3)])))
    prompt = [UserMessage(content="hi"), AssistantMessage(content="a"), UserMessage(content="more")]
    second = prepare_turn(trace, prompt)
    second.commit(Response(id="r2", created=0, model="m", message=AssistantMessage(content="b"),
                           finish_reason="stop",
                           tokens=TurnTokens(prompt_ids=[1, 2, 3, 4, 7, 8, 11, 12, 4], completion_ids=[9],
                                             completion_logprobs=[-0.5], message_spans=[(0, 3), (3, 6), (6, 8)])))
    (segment,) = to_segments(0, [b for b in trace.branches if b.trainable])
    assert segment.prompt_ids == [1, 2, 3, 4] and segment.completion_ids == [7, 8, 11, 12, 4, 9]
    assert segment.completion_mask == [1, 1, 0, 0, 0, 1]
    # the second turn's reply was never recorded: its token is unknown; the user's turn was sampled by nobody
    assert segment.completion_versions == [2, 3, None, None, None, None]


def test_a_rollout_through_verifiers_interception_carries_the_versions_of_its_tokens(tiny_model, monkeypatch):
    """The whole path in process: reverse-text's harness calls verifiers' interception server, whose training client
    sends the request through EngineClient to an engine that answers with a weight update mid-completion."""
    monkeypatch.setenv(API_KEY_VAR, "k1")
    completion = [72, 101, 108, 108, 111]

    def answer(body: dict) -> bytes:
        return reply([(completion, spans(("4", 0, 2), ("5", 2, 5)))])

    async def scenario():
        runner = await generate_engine(answer)
        renderer, _ = renderer_config("auto", str(tiny_model))
        client = InferenceClient(f"http://127.0.0.1:{runner.addresses[0][1]}", "m", str(tiny_model), renderer)
        environment = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 2}, workers=0))
        try:
            async with environment.serving():
                return await run_group(environment, 0, 1, client, Sampling(max_tokens=5), timeout_s=60)
        finally:
            await runner.cleanup()

    (result,) = asyncio.run(scenario())
    (segment,) = result.segments
    assert segment.completion_ids[-5:] == completion
    sampled = [v for v, m in zip(segment.completion_versions, segment.completion_mask, strict=True) if m]
    assert sampled == [4, 4, 5, 5, 5]


def test_a_multi_turn_episode_whose_turns_were_sampled_under_different_versions(tiny_model, monkeypatch):
    """guess-number, two model turns through verifiers' interception server: the engine serves policy 4 for the
    first and 5 for the second (an update between the turns, as continuous dispatch makes them); each turn's tokens
    keep their own version, the environment's reply between them none."""
    monkeypatch.setenv(API_KEY_VAR, "k1")
    completion, turns = [72, 101, 108, 108, 111], []  # no number in it: the environment asks again

    def answer(body: dict) -> bytes:
        turns.append(body)
        version = str(3 + len(turns))
        return reply([(completion, spans((version, 0, len(completion))))])

    async def scenario():
        runner = await generate_engine(answer)
        renderer, _ = renderer_config("auto", str(tiny_model))
        client = InferenceClient(f"http://127.0.0.1:{runner.addresses[0][1]}", "m", str(tiny_model), renderer)
        environment = load_environment(EnvConfig(id="guess-number", args={"num_examples": 2, "max_guesses": 1},
                                                 workers=0))
        try:
            async with environment.serving():
                return await run_group(environment, 0, 1, client, Sampling(max_tokens=5), timeout_s=60)
        finally:
            await runner.cleanup()

    (result,) = asyncio.run(scenario())
    assert len(turns) == 2 and result.num_turns == 2
    sampled = [v for segment in result.segments
               for v, m in zip(segment.completion_versions, segment.completion_mask, strict=True) if m]
    assert sampled == [4] * 5 + [5] * 5
    assert all(v is None for segment in result.segments
               for v, m in zip(segment.completion_versions, segment.completion_mask, strict=True) if not m)
