"""A group's identical generate requests go as one request with n samples (EngineClient's RequestGrouper)."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from aiohttp import web
from renderers import DefaultRendererConfig, create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate

from rl.envs.engine_client import (MAX_SAMPLES_PER_REQUEST, EngineClient, GroupedTrainClientConfig,
                                          RequestGrouper, split_reply)
from rl.envs.rollouts import API_KEY_VAR, InferenceClient, Sampling, model_contexts

URL = "http://engine/inference/v1/generate"
BODY = {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 1}}


def reply_with(n: int) -> bytes:
    """vLLM's reply shape: choice i sampled tokens [10 + i, 20 + i]; usage summed over the choices."""
    def entry(token: int) -> dict:
        return {"token_id": token, "logprob": -token / 100, "token": f"token_id:{token}"}

    choices = [{"index": i, "token_ids": [10 + i, 20 + i], "finish_reason": "length",
                "logprobs": {"content": [entry(10 + i), entry(20 + i)]}} for i in range(n)]
    return json.dumps({"request_id": "gen-1", "choices": choices,
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n}}).encode()


class FakeEngine:
    """The grouper's `send`: records each request and answers it with as many choices as it asked for."""

    def __init__(self, answer=None, delay_s: float = 0.0):
        self.sent: list[tuple[dict, dict | None]] = []
        self.answer = answer or (lambda body: reply_with(body["sampling_params"].get("n", 1)))
        self.delay_s = delay_s
        self.cancelled = 0

    async def __call__(self, url: str, body: dict, options: dict | None) -> bytes:
        self.sent.append((body, options))
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return self.answer(body)


def session(rollout: int, **headers) -> dict:
    return {"headers": {"X-Session-ID": f"rollout-{rollout}", **headers}}


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_identical_requests_go_as_one_with_n_samples_and_each_caller_gets_its_own_choice():
    engine = FakeEngine()

    async def scenario():
        grouper = RequestGrouper(engine, group_size=8, gap_s=0.05)
        return await asyncio.gather(*(grouper.submit(URL, BODY, session(i)) for i in range(3)))

    replies = [json.loads(reply) for reply in run(scenario())]
    assert len(engine.sent) == 1 and engine.sent[0][0]["sampling_params"] == BODY["sampling_params"] | {"n": 3}
    assert "n" not in BODY["sampling_params"]  # the callers' bodies are left as they were
    assert [r["choices"][0]["token_ids"] for r in replies] == [[10, 20], [11, 21], [12, 22]]
    assert [(len(r["choices"]), r["choices"][0]["index"]) for r in replies] == [(1, 0), (1, 1), (1, 2)]
    assert [r["request_id"] for r in replies] == ["gen-1-0", "gen-1-1", "gen-1-2"]
    assert all(r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5} for r in replies)


def test_a_full_group_goes_at_once_and_a_lone_request_after_the_gap_unchanged():
    engine = FakeEngine()

    async def scenario():
        grouper = RequestGrouper(engine, group_size=2, gap_s=20)
        start = time.monotonic()
        await asyncio.gather(grouper.submit(URL, BODY, session(0)), grouper.submit(URL, BODY, session(1)))
        full_s = time.monotonic() - start
        grouper.gap_s = 0.01
        lone = await grouper.submit(URL, BODY, session(2))
        return full_s, lone

    full_s, lone = run(scenario())
    assert full_s < 5  # not the 20 s gap
    assert [body["sampling_params"].get("n") for body, _ in engine.sent] == [2, None]
    assert engine.sent[1][0] is BODY and lone == reply_with(1)  # one caller: its own request and reply as they were


def test_only_a_rollouts_first_request_waits_for_twins():
    """A later turn (a session id seen before) has no twin to wait for: it goes at once, even with a long gap."""
    engine = FakeEngine()
    later = BODY | {"token_ids": [1, 2, 3, 10, 20, 4]}

    async def scenario():
        grouper = RequestGrouper(engine, group_size=2, gap_s=20)
        await asyncio.gather(grouper.submit(URL, BODY, session(0)), grouper.submit(URL, BODY, session(1)))
        start = time.monotonic()
        await grouper.submit(URL, later, session(0))
        return time.monotonic() - start

    assert run(scenario()) < 5
    assert [body["sampling_params"].get("n") for body, _ in engine.sent] == [2, None]


def test_a_group_larger_than_a_request_may_sample_goes_in_parts():
    engine = FakeEngine()

    async def scenario():
        grouper = RequestGrouper(engine, group_size=100, gap_s=0.05)
        await asyncio.gather(*(grouper.submit(URL, BODY, session(i)) for i in range(65)))

    run(scenario())
    assert [body["sampling_params"].get("n", 1) for body, _ in engine.sent] == [MAX_SAMPLES_PER_REQUEST, 1]


def test_requests_that_differ_go_apart_whatever_their_session_ids():
    engine = FakeEngine()
    other_prompt = BODY | {"token_ids": [1, 2, 4]}
    other_settings = BODY | {"sampling_params": BODY["sampling_params"] | {"max_tokens": 3}}

    async def scenario():
        grouper = RequestGrouper(engine, group_size=8, gap_s=0.05)
        await asyncio.gather(
            grouper.submit(URL, BODY, session(0)), grouper.submit(URL, BODY, session(1)),
            grouper.submit(URL, other_prompt, session(2)), grouper.submit(URL, other_settings, session(3)),
            grouper.submit(URL, BODY, session(4, **{"X-Team": "b"})),
        )

    run(scenario())
    assert sorted(body["sampling_params"].get("n", 1) for body, _ in engine.sent) == [1, 1, 1, 2]
    grouped = next(options for body, options in engine.sent if body["sampling_params"].get("n") == 2)
    assert grouped["headers"]["X-Session-ID"] == "rollout-0"  # the first caller's headers go with the group


@pytest.mark.parametrize("sampling", [{"seed": 7}, {"n": 2}, {}])
def test_seeded_or_multi_sample_requests_are_never_grouped(sampling):
    """n samples of one seeded request are not the samples of n requests with that seed."""
    engine = FakeEngine()
    body = BODY | {"sampling_params": BODY["sampling_params"] | sampling}

    async def scenario():
        client = EngineClient(GroupedTrainClientConfig(base_url="http://engine/v1", api_key_var=API_KEY_VAR,
                                                       group_size=8, group_gap_s=0.05))

        async def request(method, url, cast_to, options, data):  # EngineClient's HTTP, without a server
            return httpx.Response(200, content=await engine(url, json.loads(data), options))

        client._request = request
        await asyncio.gather(*(client.post(URL, cast_to=httpx.Response, body=body) for _ in range(2)))

    run(scenario())
    sent = [body["sampling_params"].get("n", 1) for body, _ in engine.sent]
    assert sent == ([2] if not sampling else [sampling.get("n", 1)] * 2)


def test_every_caller_gets_the_error_of_the_groups_request():
    def refuse(body):
        raise openai.APIConnectionError(message="engine down", request=httpx.Request("POST", URL))

    engine = FakeEngine(refuse)

    async def scenario():
        grouper = RequestGrouper(engine, group_size=8, gap_s=0.01)
        return await asyncio.gather(*(grouper.submit(URL, BODY, session(i)) for i in range(3)), return_exceptions=True)

    errors = run(scenario())
    assert len(engine.sent) == 1 and all(isinstance(e, openai.APIConnectionError) for e in errors)


def test_a_reply_short_of_samples_or_not_json_fails_every_caller():
    with pytest.raises(openai.APIError, match="for 3 samples with 2"):
        split_reply(URL, reply_with(2), 3)
    for body in (b"<html>", b"[1, 2]", b'{"choices": 7}'):
        with pytest.raises(openai.APIError, match="no JSON object of choices"):
            split_reply(URL, body, 3)


def test_a_caller_gone_before_its_group_goes_is_left_out_and_a_group_nobody_waits_for_is_cancelled():
    engine = FakeEngine(delay_s=10)

    async def scenario():
        grouper = RequestGrouper(engine, group_size=8, gap_s=0.05)
        callers = [asyncio.ensure_future(grouper.submit(URL, BODY, session(i))) for i in range(3)]
        await asyncio.sleep(0.01)
        callers[0].cancel()  # before the group goes
        await asyncio.sleep(0.1)  # the group has gone, without it
        assert len(engine.sent) == 1 and engine.sent[0][0]["sampling_params"]["n"] == 2
        for caller in callers[1:]:
            caller.cancel()
        await asyncio.sleep(0.05)
        return engine.cancelled

    assert run(scenario()) == 1  # the request nobody waits for any more is cancelled, not left running


def test_a_groups_rollouts_share_a_config_that_names_the_group_size():
    client = InferenceClient("http://127.0.0.1:8000", "m", "m", None, group_gap_s=0.004)
    contexts = model_contexts(client, Sampling(), 4)
    assert contexts[0].client.group_size == 4 and contexts[0].client.group_gap_s == 0.004
    assert isinstance(EngineClient(contexts[0].client).grouper, RequestGrouper)
    no_gap = model_contexts(InferenceClient("http://127.0.0.1:8000", "m", "m", None, group_gap_s=0), Sampling(), 4)
    assert EngineClient(no_gap[0].client).grouper is None


def test_renderers_parse_each_callers_choice_from_a_real_engine(tiny_model, monkeypatch):
    """Through verifiers' request path (renderers' generate over EngineClient) against a local HTTP engine that
    answers vLLM's way: one request with n = 4, each caller's completion its own choice's tokens and logprobs."""
    monkeypatch.setenv(API_KEY_VAR, "k1")
    renderer = create_renderer(load_tokenizer(str(tiny_model)), DefaultRendererConfig())
    seen: list = []

    async def generate_route(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.Response(body=reply_with(body["sampling_params"].get("n", 1)), content_type="application/json")

    async def scenario():
        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate_route)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        config = GroupedTrainClientConfig(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
                                          api_key_var=API_KEY_VAR, group_size=4, group_gap_s=0.05)
        client = EngineClient(config)
        try:
            return await asyncio.gather(*(
                generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}], model="m",
                         sampling_params={"max_tokens": 2}, extra_headers={"X-Session-ID": f"rollout-{i}"},
                         max_prompt_len=64)  # not looked up: renderers' lookup lock belongs to the first test's loop
                for i in range(4)))
        finally:
            await client.close()
            await runner.cleanup()

    results = run(scenario())
    assert len(seen) == 1 and seen[0]["sampling_params"]["n"] == 4
    assert sorted(r["completion_ids"] for r in results) == [[10 + i, 20 + i] for i in range(4)]
    assert all(r["completion_logprobs"] == [-t / 100 for t in r["completion_ids"]] for r in results)
    assert all(r["usage"]["completion_tokens"] == 2 for r in results)
