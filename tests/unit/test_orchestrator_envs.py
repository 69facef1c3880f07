"""The offline environment packages: tasks from a seed, the env's replies, the tool protocol, and
clear start-up errors for unknown ids and bad args."""

import asyncio

import pytest
from aiohttp import web

from rl.envs import chat_calls
from guess_number import feedback, parse_guess
from in_process_chat import ModelCallError, SharedChatSession, complete
from rl.envs.config import EnvConfig
from rl.envs.loading import load_environment as load_spec
from tool_calc import CalcToolset, ToolCalcTaskset, last_number


def load_environment(env_id: str, args: dict, overrides: dict | None = None):
    return load_spec(EnvConfig(id=env_id, args=args, overrides=overrides or {}))


def test_guess_number_tasks_and_feedback():
    env = load_environment("guess-number", {"num_examples": 5, "low": 1, "high": 10, "seed": 3})
    again = load_environment("guess-number", {"num_examples": 8, "low": 1, "high": 10, "seed": 3})
    targets = [t.data.target for t in env.tasks]
    assert targets == [t.data.target for t in again.tasks][:5]  # task i depends only on (seed, i)
    assert all(1 <= t <= 10 for t in targets)
    assert parse_guess("maybe 7?") == 7 and parse_guess("no idea") is None
    assert [feedback(3, 5), feedback(8, 5), feedback(5, 5), feedback(None, 5)] == [
        "higher", "lower", "correct", "Reply with a number."
    ]


def test_tool_calc_serves_its_tools_as_a_shared_mcp_toolset():
    env = load_environment("tool-calc", {"num_examples": 3, "seed": 1})
    assert env.tasks[0].data.prompt.startswith("What is (") and env.toolsets == ["CalcToolset"]
    (toolset,) = ToolCalcTaskset.toolsets(env.env.taskset.config)
    assert isinstance(toolset, CalcToolset) and toolset.server_name == ""  # offered bare: add, multiply
    assert (toolset.add(2, 3), toolset.multiply(4, 6)) == (5, 24)
    assert last_number("it is 3 then 12") == 12 and last_number("none") is None


@pytest.mark.parametrize(
    ("env_id", "args", "named"),
    [
        ("no-such-env", {}, "no-such-env"),
        ("guess-number", {"low": 5, "high": 5}, "low (5) must be < high (5)"),
        ("tool-calc", {"bogus": 1}, "bogus"),
    ],
)
def test_bad_environments_fail_at_start_up_naming_the_problem(env_id, args, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_environment(env_id, args)


def test_task_keys_are_the_durable_data_ids_else_the_content_hash():
    for env_id in ("reverse-text", "guess-number", "tool-calc"):
        tasks = load_environment(env_id, {"num_examples": 3, "seed": 4}).tasks
        assert [t.key for t in tasks] == ["s4-0", "s4-1", "s4-2"]
    without_id = tasks[0].with_data(id=None)
    assert without_id.key == without_id.hash and len(without_id.hash) == 64


def test_interception_servers_hold_few_rollouts_unless_overridden():
    assert load_environment("reverse-text", {"num_examples": 2}).env.config.interception.multiplex == 8
    own = {"interception": {"type": "elastic", "multiplex": 2}}
    assert load_environment("reverse-text", {"num_examples": 2}, own).env.config.interception.multiplex == 2


class EnvHooks:
    """Stands in for `vf.Env`'s start/stop hooks (no-ops there too)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class FakeEnv(SharedChatSession, EnvHooks):
    pass


async def chat_server(peers: list) -> web.AppRunner:
    """A chat endpoint that answers "ok", or 400 when the model is "too-long", recording each peer."""

    async def chat(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        if (await request.json())["model"] == "too-long":
            return web.Response(status=400, text="prompt is longer than the context")
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_model_calls_share_one_connection_while_environments_serve():
    async def scenario() -> None:
        peers: list = []
        runner = await chat_server(peers)
        port = runner.addresses[0][1]
        endpoint = f"http://127.0.0.1:{port}/v1"
        first, second = FakeEnv(), FakeEnv()
        await first.start()
        await second.start()  # env mixing: both hold the loop's one session
        for _ in range(3):
            assert await complete(endpoint, "secret", "m", [{"role": "user", "content": "hi"}]) == "ok"
        with pytest.raises(ModelCallError, match="400: prompt is longer than the context"):
            await complete(endpoint, "secret", "too-long", [])
        await first.stop()
        assert await complete(endpoint, "secret", "m", []) == "ok"  # still shared: `second` serves
        session = chat_calls._shared[asyncio.get_running_loop()][0]
        await second.stop()
        assert session.closed and not chat_calls._shared
        assert await complete(endpoint, "secret", "m", []) == "ok"  # outside serving: its own session
        await runner.cleanup()
        assert len(peers) == 6 and len(set(peers[:5])) == 1 and peers[5] != peers[0]

    asyncio.run(scenario())


def test_reasoning_gym_tasks_are_reproducible_and_scored_by_the_dataset():
    from reasoning_gym_env import entry_score

    args = {"dataset": "basic_arithmetic", "num_examples": 6, "seed": 2,
            "dataset_args": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}
    env = load_environment("reasoning-gym-env", args)
    again = load_environment("reasoning-gym-env", args)
    assert [t.data.prompt for t in env.tasks] == [t.data.prompt for t in again.tasks]
    assert "rl's default" in env.describe()  # a Taskset-only package: rl's harness and the local runtime
    task = env.tasks[0].data
    assert entry_score(task, task.answer) == 1.0 and entry_score(task, f"<answer>{task.answer}</answer>") == 1.0
    assert entry_score(task, "no idea") == 0.0
    with pytest.raises(ValueError, match="args: Value error, reasoning-gym dataset 'no_such_dataset'.*not registered"):
        load_environment("reasoning-gym-env", {"dataset": "no_such_dataset"})
    with pytest.raises(ValueError, match="args: .*max_terms must be >= min_terms"):
        load_environment("reasoning-gym-env", args | {"dataset_args": {"min_terms": 3, "max_terms": 2}})


def test_rollouts_reach_their_interception_server_in_process_not_over_http(monkeypatch):
    """An env server's worker offers each interception server's model route in process (rl.envs.chat_calls): a
    rollout's model calls go to verifiers' handler directly (HTTP to the server is refused here), and are recorded
    and answered as before. The episodes run here as a worker runs them (its environment serving, the shared
    session held)."""
    from rl.envs.rollouts import ChatClient, Sampling, model_contexts, to_chat_result

    async def over_http(*args, **kwargs):
        raise AssertionError("a model call went over HTTP to the interception server")

    async def scenario() -> None:
        asked: list[dict] = []

        async def provider(request: web.Request) -> web.Response:  # the model, behind verifiers' eval client
            asked.append(await request.json())
            return web.json_response({
                "id": "c", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "olleh"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            })

        app = web.Application()
        app.router.add_post("/v1/chat/completions", provider)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        env = load_environment("reverse-text", {"num_examples": 2})
        client = ChatClient(f"http://127.0.0.1:{runner.addresses[0][1]}", "m")
        contexts = model_contexts(client, Sampling(temperature=1.0, max_tokens=8), 2)
        async with chat_calls.shared_session(), env.env.serving():
            slots = env.env.slots(env.task(1), 2)
            episodes = await asyncio.gather(*(env.env.run_slot(slot, ctx) for slot, ctx in zip(slots, contexts)))
        results = [to_chat_result(1, env.task(1), episode) for episode in episodes]
        await runner.cleanup()
        assert not chat_calls._local_routes  # withdrawn with the servers (started by the first rollouts)
        prompt = env.task(1).data.prompt
        assert [r.chat.completion for r in results] == [[{"role": "assistant", "content": "olleh"}]] * 2
        assert [r.chat.prompt[-1]["content"] for r in results] == [prompt] * 2
        assert len(asked) == 2 and all(body["messages"][-1]["content"] == prompt for body in asked)

    monkeypatch.setattr(chat_calls, "_send", over_http)
    asyncio.run(scenario())
