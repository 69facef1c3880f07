"""EngineClient: the aiohttp transport under verifiers' training client, against a local HTTP engine."""

import asyncio

import openai
import pytest
import verifiers.v1 as vf
from aiohttp import web
from renderers import DefaultRendererConfig, create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.errors import model_error

from rl.envs.engine_client import EngineClient
from rl.config import API_KEY_VAR
from rl.envs.rollouts import InferenceClient, Sampling, model_contexts

TOKENS = [11, 12, 13]


async def engine(seen: list) -> web.AppRunner:
    """/inference/v1/generate answering three tokens (or the status the prompt's first id asks for),
    /v1/models, and /slow, which answers after 2 s."""

    async def generate_route(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((dict(request.headers), body))
        if body["token_ids"][0] >= 400:
            return web.json_response({"error": {"message": "prompt too long"}}, status=body["token_ids"][0])
        content = [{"token": f"token_id:{t}", "logprob": -0.5} for t in TOKENS]
        choice = {"token_ids": TOKENS, "logprobs": {"content": content}, "finish_reason": "length"}
        return web.json_response({"request_id": "r1", "choices": [choice]})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate_route)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def config(base_url: str, **fields) -> vf.TrainClientConfig:
    return vf.TrainClientConfig(base_url=base_url, api_key_var=API_KEY_VAR, **fields)


def test_training_client_generates_through_the_engine_client(tiny_model, monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "k1")
    renderer = create_renderer(load_tokenizer(str(tiny_model)), DefaultRendererConfig())

    async def scenario() -> None:
        seen: list = []
        runner = await engine(seen)
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        train_client = TrainClient(config(base, headers={"X-Team": "t"}))
        client = train_client.client
        assert isinstance(client, EngineClient)  # verifiers builds ours, not the OpenAI SDK client
        result = await generate(
            client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}], model="m",
            sampling_params={"max_tokens": 3}, extra_headers={"X-Session-ID": "trace-1"},
        )
        assert result["completion_ids"] == TOKENS and result["completion_logprobs"] == [-0.5] * 3
        headers, body = seen[0]
        assert body["model"] == "m" and body["sampling_params"]["max_tokens"] == 3 and body["token_ids"]
        assert headers["Authorization"] == "Bearer k1" and headers["X-Team"] == "t"
        assert headers["X-Session-ID"] == "trace-1"
        assert await client.get("/models", cast_to=dict) == {"data": [{"id": "m", "max_model_len": 64}]}
        await train_client.close()
        assert client.session.closed
        await runner.cleanup()

    asyncio.run(scenario())


def test_a_priority_sampling_setting_goes_to_the_requests_top_level_where_vllm_reads_it(tiny_model, monkeypatch):
    """The orchestrator's group number rides in the sampling settings (verifiers forwards them inside
    sampling_params, which vLLM would not read it from); the engine client moves it up."""
    monkeypatch.setenv(API_KEY_VAR, "k1")
    renderer = create_renderer(load_tokenizer(str(tiny_model)), DefaultRendererConfig())
    contexts = model_contexts(InferenceClient("http://x/v1", "m", "m", None), Sampling(priority=7), 2)
    assert contexts[0].sampling.model_dump(exclude_none=True)["priority"] == 7

    async def scenario() -> list:
        seen: list = []
        runner = await engine(seen)
        client = EngineClient(config(f"http://127.0.0.1:{runner.addresses[0][1]}/v1"))
        for sampling in ({"max_tokens": 3, "priority": 7}, {"max_tokens": 3}):
            await generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}],
                           model="m", sampling_params=sampling)
        await client.close()
        await runner.cleanup()
        return [body for _, body in seen]

    prioritized, plain = asyncio.run(scenario())
    assert prioritized["priority"] == 7 and "priority" not in prioritized["sampling_params"]
    assert prioritized["sampling_params"]["max_tokens"] == 3
    assert "priority" not in plain


def test_engine_failures_raise_the_sdk_errors_verifiers_maps_to_statuses():
    """A status error keeps the engine's status (4xx is not retried by the harness), an unreachable engine
    reads 503 and a read timeout 504, as with the OpenAI SDK client."""

    async def failure(client: EngineClient, path: str, token: int = 1) -> openai.OpenAIError:
        with pytest.raises(openai.OpenAIError) as caught:
            await client.post(path, cast_to=dict, body={"token_ids": [token]})
        return caught.value

    async def scenario() -> None:
        runner = await engine([])
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        client = EngineClient(config(base, timeout={"read": 0.3}))
        error = await failure(client, f"{base[:-3]}/inference/v1/generate", token=413)
        assert isinstance(error, openai.APIStatusError) and error.status_code == 413
        assert "prompt too long" in str(error) and error.body == {"error": {"message": "prompt too long"}}
        assert model_error(error).status_code == 413
        error = await failure(client, f"{base[:-3]}/slow")
        assert isinstance(error, openai.APITimeoutError) and model_error(error).status_code == 504
        await client.close()
        await runner.cleanup()
        unreachable = EngineClient(config(base))  # the server is gone
        error = await failure(unreachable, f"{base[:-3]}/inference/v1/generate")
        assert type(error) is openai.APIConnectionError and model_error(error).status_code == 503
        assert f"{base[:-3]}/inference/v1/generate" in str(error)
        await unreachable.close()

    asyncio.run(scenario())


def test_engine_client_refuses_a_return_type_it_does_not_build():
    async def scenario() -> None:
        runner = await engine([])
        client = EngineClient(config(f"http://127.0.0.1:{runner.addresses[0][1]}/v1"))
        with pytest.raises(TypeError, match="httpx.Response or dict"):
            await client.get("/models", cast_to=list)
        await client.close()
        await runner.cleanup()

    asyncio.run(scenario())


def test_a_redirect_is_not_followed_and_the_key_goes_nowhere_else(monkeypatch):
    """An allowed engine that answers 307 to a port nobody allowed: the request fails naming the redirect, and the
    other port never sees the key (aiohttp strips only Authorization across origins, not other headers)."""
    monkeypatch.setenv(API_KEY_VAR, "k-secret")
    monkeypatch.setenv("TEAM_TOKEN", "t-secret")

    async def scenario() -> None:
        elsewhere: list = []
        other = await engine(elsewhere)
        target = f"http://127.0.0.1:{other.addresses[0][1]}/inference/v1/generate"

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(target)

        app = web.Application()
        app.router.add_post("/inference/v1/generate", redirect)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        client = EngineClient(config(base, headers_from_env={"X-Team": "TEAM_TOKEN"}))
        with pytest.raises(openai.APIStatusError, match="a redirect to .*not followed") as caught:
            await client.post(f"{base[:-3]}/inference/v1/generate", cast_to=dict, body={"token_ids": [1]})
        assert caught.value.status_code == 307 and elsewhere == []
        await client.close()
        await runner.cleanup()
        await other.cleanup()

    asyncio.run(scenario())

