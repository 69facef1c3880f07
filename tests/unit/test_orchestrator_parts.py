import asyncio

import pytest

from rl.orchestrator.batch import balance_by_tokens
from rl.envs.slots import RolloutSlots
from rl.orchestrator.sampler import TaskSampler
from rl.samples import Sample


def test_a_whole_batch_is_in_flight_unless_max_concurrent_says_otherwise():
    from rl.orchestrator.config import OrchestratorConfig

    assert OrchestratorConfig(batch_size=128).rollouts_in_flight == 128
    assert OrchestratorConfig(batch_size=128, max_concurrent=16).rollouts_in_flight == 16
    assert OrchestratorConfig(batch_size=32, max_concurrent=64).rollouts_in_flight == 64


def test_sampler_draws_each_task_once_per_epoch_and_resumes():
    sampler = TaskSampler(10, seed=1)
    first = sampler.draw(10)
    assert sorted(first) == list(range(10))
    resumed = TaskSampler(**{**sampler.state_dict()})
    assert resumed.draw(4) == sampler.draw(4)
    assert sampler.epoch == 1


def test_balance_by_tokens_equal_counts_and_close_tokens():
    samples = [Sample([0] * n, [1] * n, [0.0] * n, 0.0, 0.0, 0) for n in (10, 9, 8, 1, 1, 1)]
    buckets = balance_by_tokens(samples, 2)
    assert [len(b) for b in buckets] == [3, 3]
    tokens = [sum(len(s.input_ids) for s in b) for b in buckets]
    assert abs(tokens[0] - tokens[1]) <= 10
    with pytest.raises(ValueError):
        balance_by_tokens(samples[:5], 2)


class _UnhashableFactory:
    __hash__ = None

    def __call__(self) -> list:
        return ["made"]


def test_default_factories_behave_the_same_with_their_inspection_cached():
    """rollouts caches pydantic's per-construct inspection of default factories (a CPU hot spot); every
    kind of factory must still give what pydantic gives."""
    from pydantic import BaseModel, Field
    from pydantic._internal import _fields


    class Model(BaseModel):
        a: int = 1
        plain: list = Field(default_factory=list)
        from_data: int = Field(default_factory=lambda data: data["a"] * 2)
        odd: list = Field(default_factory=_UnhashableFactory())

    hits = _fields.takes_validated_data_argument.cache_info().hits
    for _ in range(3):
        made = Model.model_construct(a=5)
        assert (made.plain, made.from_data, made.odd) == ([], 10, ["made"])
    assert Model(a=4).from_data == 8
    assert _fields.takes_validated_data_argument.cache_info().hits > hits


def test_gc_tuned_for_serving_freezes_the_startup_heap_and_collects_young_objects_less_often():
    import gc

    from rl.envs.process_setup import YOUNG_GC_THRESHOLD, tune_gc_for_serving

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])  # CPython's default; an in-process orchestrator test may have tuned it
        tune_gc_for_serving()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def rollout(reward: float, metrics: dict | None = None, rewards: dict | None = None, task_index: int = 0, **tools):
    from rl.envs.rollouts import RolloutResult, TokenSegment

    segment = TokenSegment([1, 2], [3, 4], [1, 1], [-0.1, -0.2])
    return RolloutResult(task_index, "t", [segment], reward, rewards or {"r": reward}, metrics or {}, False, 1, **tools)


def test_step_stats_carry_each_environments_metrics_components_and_counts():
    from rl.orchestrator.stats import rollout_stats

    stats = rollout_stats({
        "echo": [rollout(1.0, {"exact": 1.0}), rollout(0.0, {"exact": 0.0, "chars": 4.0})],
        "calc": [rollout(0.5, {"tool_calls": 2.0}, {"correct": 0.0, "tool_use": 1.0})],
    })
    assert stats["rollouts/echo"] == 2 and stats["rollouts/calc"] == 1
    assert stats["metric/echo/exact"] == 0.5 and stats["metric/echo/chars"] == 4.0  # over the rollouts that have it
    assert stats["metric/calc/tool_calls"] == 2.0 and "metric/calc/exact" not in stats
    assert stats["reward/calc/tool_use"] == 1.0 and stats["reward/echo"] == 0.5
    assert stats["reward"] == pytest.approx(0.5)


def test_pass_at_k_is_the_unbiased_estimate_and_avg_at_n_the_mean_reward():
    from rl.orchestrator.eval import EvalGroups, eval_stats, group_scores, ks, pass_at_k

    assert ks(1) == [1] and ks(4) == [1, 2, 4] and ks(6) == [1, 2, 4, 6]
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    one_right = [rollout(1.0), rollout(0.2), rollout(0.2), rollout(0.2)]
    none_right = [rollout(0.9)] * 4
    scores = group_scores([one_right, none_right], pass_threshold=1.0)
    assert scores == pytest.approx({"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5, "avg@4": (0.4 + 0.9) / 2})
    assert group_scores([none_right], pass_threshold=0.9)["pass@1"] == 1.0  # the threshold decides
    stats = eval_stats(EvalGroups({"a": [one_right], "b": [none_right]}, {"a": [], "b": []}, 4), 1.0)
    assert stats["eval/pass@4"] == 0.5 and stats["eval/pass@4/a"] == 1.0 and stats["eval/pass@4/b"] == 0.0
    assert stats["eval/rollouts/a"] == 4 and stats["eval/dropped"] == 0


def test_a_failing_eval_group_is_retried_then_dropped_and_counted(monkeypatch):
    """One eval task's rollouts always fail: the others are scored, it is counted under eval/dropped."""
    import asyncio

    from rl.envs import rollouts
    from rl.orchestrator.config import EvalConfig
    from rl.orchestrator.eval import eval_stats, run_eval_groups

    attempts = []

    async def stand_in_group(env, task_index, n, client, sampling, slots=None, timeout_s=None):
        attempts.append(task_index)
        if task_index == 1:
            raise rollouts.RolloutError("rollout of task 1 failed: ProviderError: boom")
        return [rollout(1.0, task_index=task_index)] * n

    class Env:
        name, num_tasks = "echo", 3

    monkeypatch.setattr(rollouts, "run_group", stand_in_group)
    logged = []
    config = EvalConfig(num_examples=3, rollouts_per_example=2, sampling={"temperature": 1.0})
    evaluated = asyncio.run(run_eval_groups(config, [Env()], 3, [None], RolloutSlots(4), None, 2, logged.append))
    assert sorted(attempts) == [0, 1, 1, 1, 2] and len(logged) == 3  # task 1: once and 2 retries
    assert [[r.task_index for r in g] for g in evaluated.groups["echo"]] == [[0, 0], [2, 2]]
    assert evaluated.dropped == {"echo": ["RolloutError: rollout of task 1 failed: ProviderError: boom"]}
    stats = eval_stats(evaluated, 1.0)
    assert stats["eval/dropped"] == 2 and stats["eval/dropped/echo"] == 2 and stats["eval/rollouts/echo"] == 4


def test_tool_and_turn_stats_per_environment():
    from rl.orchestrator.stats import rollout_stats

    with_tools = [rollout(1.0, tool_calls=2, tool_errors=1), rollout(0.0, tool_calls=0, tool_errors=0)]
    stats = rollout_stats({"calc": with_tools, "chat": [rollout(1.0)]})
    assert stats["tools/calc/calls"] == 1.0 and stats["tools/calc/errors"] == 0.5
    assert stats["turns/calc"] == 1 and "tools/chat/calls" not in stats


def test_a_patch_whose_target_is_gone_fails_loudly_naming_it():
    import types

    from rl.patches import PatchTargetMissing, patch_target

    moved = types.ModuleType("verifiers.v1.clients.train")
    gone = r"verifiers.v1.clients.train.build_async_openai is gone in verifiers 0\.4\.0"
    with pytest.raises(PatchTargetMissing, match=gone):
        patch_target(moved, "build_async_openai", "verifiers")
    moved.build_async_openai = object
    assert patch_target(moved, "build_async_openai", "verifiers") is object


def test_an_env_pool_that_no_longer_starts_workers_from_a_context_is_refused_naming_it():
    import types

    from rl.patches import PatchTargetMissing, fork_pool_workers

    for pool in (types.SimpleNamespace(), types.SimpleNamespace(_mpctx="spawn")):
        with pytest.raises(PatchTargetMissing, match=r"EnvServerPool no longer starts its workers from `_mpctx`"):
            fork_pool_workers(pool)


def test_verifiers_pool_builds_rls_worker_server_and_takes_no_other_class(monkeypatch):
    from verifiers.v1.serve import pool, server

    from rl.envs.worker_server import WorkerServer
    from rl.patches import serve_env_with

    monkeypatch.setattr(pool, "EnvServer", server.EnvServer)  # as verifiers leaves it, put back after the test
    with pytest.raises(TypeError, match="dict is not a subclass of verifiers' EnvServer"):
        serve_env_with(dict)
    serve_env_with(WorkerServer)
    assert pool.EnvServer is WorkerServer  # the name serve_env builds each worker's server by


def test_training_rollouts_ask_vllm_for_tokens_only_unless_stop_strings_need_the_text():
    from rl.envs.rollouts import ChatClient, InferenceClient, Sampling, model_contexts

    def model_context(client, sampling, _):
        return model_contexts(client, sampling, 1)[0]

    train = InferenceClient("http://127.0.0.1:8000", "m", "/models/m", renderer=None)
    chat = ChatClient("http://127.0.0.1:8000", "m")
    sampled = model_context(train, Sampling(max_tokens=4), 0).sampling.model_dump(exclude_none=True)
    assert sampled["detokenize"] is False and sampled["max_tokens"] == 4
    stopped = model_context(train, Sampling(extra={"stop": ["\n"]}), 0).sampling.model_dump(exclude_none=True)
    assert "detokenize" not in stopped and stopped["stop"] == ["\n"]
    assert "detokenize" not in model_context(chat, Sampling(), 0).sampling.model_dump(exclude_none=True)


def test_a_groups_rollouts_share_their_configs_and_seeded_ones_get_a_seed_each():
    from rl.envs.rollouts import InferenceClient, Sampling, model_contexts

    train = InferenceClient("http://127.0.0.1:8000", "m", "/models/m", renderer=None)
    unseeded = model_contexts(train, Sampling(max_tokens=4), 3)
    assert len(unseeded) == 3 and len({id(c.client) for c in unseeded} | {id(c.sampling) for c in unseeded}) == 2
    assert "seed" not in unseeded[0].sampling.model_dump() and unseeded[0].client.base_url == "http://127.0.0.1:8000/v1"
    seeded = model_contexts(train, Sampling(max_tokens=4, seed=7), 3)
    assert [c.sampling.model_dump()["seed"] for c in seeded] == [7, 8, 9] and len({id(c.client) for c in seeded}) == 1


def test_renderers_built_for_the_training_client_render_a_repeated_prompt_once_and_hand_out_copies(
        tiny_model, monkeypatch):
    import renderers
    from renderers.base import load_tokenizer

    from rl.renderer import renderer_config

    def build():
        return renderers.create_renderer(load_tokenizer(str(tiny_model)), renderer_config("auto", str(tiny_model))[0])

    plain = build().render.__wrapped__  # a renderer's own render, bound before the count below
    calls, own = [], type(plain.__self__).render
    monkeypatch.setattr(type(plain.__self__), "render", lambda self, *a, **k: calls.append(1) or own(self, *a, **k))
    renderer, messages = build(), [{"role": "user", "content": "reverse: abc"}]
    first = renderer.render(messages, tools=None, add_generation_prompt=True)
    second = renderer.render(messages, tools=None, add_generation_prompt=True)
    assert len(calls) == 1
    assert first.token_ids == second.token_ids == plain(messages, tools=None, add_generation_prompt=True).token_ids
    first.token_ids.append(-1)  # each caller owns its copy
    assert renderer.render(messages, tools=None, add_generation_prompt=True).token_ids == second.token_ids
    assert renderer.render(messages, tools=None, add_generation_prompt=False).token_ids != second.token_ids
    assert len(calls) == 2  # every argument is part of the key

    unpicklable = lambda: None  # noqa: E731 - a render holding what pickle refuses is rendered each time, not lost
    monkeypatch.setattr(type(plain.__self__), "render", lambda self, *a, **k: calls.append(1) or unpicklable)
    renderer = build()
    assert [renderer.render(messages), renderer.render(messages)] == [unpicklable, unpicklable] and len(calls) == 4


def test_a_rollouts_working_directory_is_made_at_its_first_use_and_removed_only_where_made(tmp_path, monkeypatch):
    import asyncio

    from verifiers.v1.runtimes import subprocess as runtimes


    monkeypatch.setattr(runtimes, "CACHE_DIR", tmp_path)

    async def rollout(name: str, use: bool) -> tuple[bool, bool, bool]:
        runtime = runtimes.SubprocessRuntime(runtimes.SubprocessConfig(), name)
        await runtime.start()
        made_at_start = runtime.workdir.exists()
        if use:  # a harness that runs a program there: it runs in the directory, as before
            result = await runtime.run(["sh", "-c", "pwd > where"], {})
            assert result.exit_code == 0
            assert (await runtime.read("where")).decode().strip() == str(runtime.workdir)
        made = runtime.workdir.exists()
        await runtime.teardown()
        return made_at_start, made, runtime.workdir.exists()

    assert asyncio.run(rollout("chat", use=False)) == (False, False, False)  # rl's in-process chat: none made
    assert asyncio.run(rollout("program", use=True)) == (False, True, False)  # made when used, removed after
    assert not list((tmp_path / "runtimes" / "subprocess").iterdir())


def test_a_renderers_tokenizer_encodes_a_short_string_once_and_hands_out_copies(tiny_model):
    from renderers.base import load_tokenizer

    from rl import patches

    tokenizer = load_tokenizer(str(tiny_model))
    calls, own = [], tokenizer.encode
    tokenizer.encode = lambda text, *args, **kwargs: calls.append(text) or own(text, *args, **kwargs)
    patches.remember_short_encodes(tokenizer)
    patches.remember_short_encodes(tokenizer)  # once per tokenizer
    header = "<|im_start|>assistant\n"
    first = tokenizer.encode(header, add_special_tokens=False)
    second = tokenizer.encode(header, add_special_tokens=False)
    assert first == second == own(header, add_special_tokens=False) and len(calls) == 1
    first.append(-1)  # each caller owns its copy
    assert tokenizer.encode(header, add_special_tokens=False) == second
    tokenizer.encode(header)  # other arguments: another key
    long_text = "reverse this " * 10  # a prompt, not a marker: never remembered
    tokenizer.encode(long_text, add_special_tokens=False)
    tokenizer.encode(long_text, add_special_tokens=False)
    assert calls == [header, header, long_text, long_text]


def test_harness_classes_are_looked_up_once_per_id():
    from verifiers.v1.utils import loaders


    first = loaders.harness_class("in_process_chat")
    assert loaders.harness_class("in_process_chat") is first and loaders.harness_class.cache_info().hits >= 1
    with pytest.raises(ModuleNotFoundError):  # a failed lookup is not remembered: it fails again
        loaders.harness_class("no_such_harness_anywhere")


def test_a_renderer_slot_hands_out_a_remembered_render_on_the_loop_and_sends_other_work_to_a_thread(
        tiny_model, monkeypatch):
    import asyncio
    import threading

    import renderers
    from renderers.base import load_tokenizer
    from verifiers.v1.clients.train import RendererSlot

    from rl.renderer import renderer_config

    kind = type(renderers.create_renderer(load_tokenizer(str(tiny_model)), renderer_config("auto", str(tiny_model))[0])
                .render.__wrapped__.__self__)
    bridged = []
    monkeypatch.setattr(kind, "bridge_to_next_turn", lambda self, *a, **k: bridged.append(threading.get_ident()))
    slot = RendererSlot(renderers.create_renderer(load_tokenizer(str(tiny_model)),
                                                  renderer_config("auto", str(tiny_model))[0]))
    messages, tried_on = [{"role": "user", "content": "reverse: abc"}], []

    def render():
        tried_on.append(threading.get_ident())
        return slot.renderer.render(messages, tools=None, add_generation_prompt=True)

    async def main():
        loop = threading.get_ident()
        first = await slot.run(render)  # not remembered: tried on the loop, then rendered in a thread
        assert tried_on[0] == loop and tried_on[1] != loop and len(tried_on) == 2
        second = await slot.run(render)  # remembered: handed out on the loop
        assert tried_on[2:] == [loop] and second.token_ids == first.token_ids
        await slot.run(lambda: slot.renderer.bridge_to_next_turn([1], [2], []))  # never on the loop
        assert len(bridged) == 1 and bridged[0] != loop
        slot.lock.acquire()  # the slot is busy in a thread: the work waits there, not on the loop
        waiting = asyncio.ensure_future(slot.run(render))
        await asyncio.sleep(0.05)
        assert not waiting.done() and tried_on[3:] == []
        slot.lock.release()
        assert (await waiting).token_ids == first.token_ids and tried_on[3] != loop

    asyncio.run(main())


def test_a_tasks_content_hash_is_computed_once_per_data_object(monkeypatch):
    import verifiers.v1 as vf
    from verifiers.v1 import task as task_module


    computed = []
    real = task_module.task_key
    monkeypatch.setattr(task_module, "task_key", lambda data: computed.append(data) or real(data))
    task = vf.Task(vf.TaskData(prompt="reverse: abc"))
    first = task.hash
    assert task.hash == first and len(computed) == 1
    assert first == real(task.data.model_dump(mode="json", exclude_none=True))  # verifiers' own hash
    other = task.with_data(prompt="reverse: abd")  # another data object: its own hash
    assert other.hash != first and len(computed) == 2
    assert task.hash == first and len(computed) == 2


def test_verifiers_reads_a_hooks_signature_once_per_function():
    import inspect

    from verifiers.v1.utils import decorators


    reads = []
    real = inspect.signature
    decorators.inspect._inspect = type("Counting", (), {"signature": staticmethod(
        lambda fn: reads.append(fn) or real(fn))})()
    decorators.inspect._memory.clear()
    try:
        class Task:
            def reward(self, trace, runtime=None):
                return (self, trace, runtime)

            def anything(*args):
                return args

        first, second = Task(), Task()
        available = {"trace": "t", "runtime": "r", "unused": 0}
        assert decorators.invoke(first.reward, available) == (first, "t", "r")
        assert decorators.invoke(second.reward, available) == (second, "t", "r")  # another instance: remembered
        assert decorators.invoke(first.anything, available) == (first,)  # *args: as inspect reads it
        assert len(reads) == 2
        assert decorators.invoke(lambda trace: trace, available) == "t" and len(reads) == 3
    finally:
        decorators.inspect._inspect = inspect
        decorators.inspect._memory.clear()


def test_engine_replies_are_decoded_by_msgspec_and_by_json_where_they_are_not_strict_json():
    import json

    from renderers import client as renderers_client


    decoder, decoded = renderers_client.json, []
    real_decode = decoder._decode
    decoder._decode = lambda text: decoded.append(text) or real_decode(text)
    try:
        strict = b'{"choices": [{"token_ids": [3, 5], "logprobs": {"content": [{"token_id": 3, "logprob": -0.25}]}}]}'
        assert renderers_client.parse_generate_response(strict) == json.loads(strict) and decoded == [strict]
        loose = strict.replace(b"-0.25", b"-Infinity")  # as vLLM writes a -inf logprob
        assert renderers_client.parse_generate_response(loose) == json.loads(loose) and len(decoded) == 2
        assert renderers_client.json.dumps({"a": 1}) == json.dumps({"a": 1})  # the rest is the json module's
    finally:
        decoder._decode = real_decode


def test_a_route_called_in_process_answers_as_http_would_and_never_outlives_its_caller():
    from aiohttp import web

    from rl.patches.verifiers import local_route

    async def scenario() -> None:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def handler(request) -> web.Response:
            body = await request.read()
            if body == b"boom":
                raise ValueError("boom")
            if body == b"stream":
                return web.StreamResponse()
            if body == b"hang":
                started.set()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
            request["state"] = 1  # per-request state, as verifiers keeps there
            return web.json_response({"path": request.path, "auth": request.headers["authorization"]}, status=201)

        call = local_route(handler, "/v1/chat/completions", max_body=8)
        assert await call({"Authorization": "Bearer s"}, b"{}") == (201, b'{"path": "/v1/chat/completions", '
                                                                         b'"auth": "Bearer s"}')
        status, text = await call({}, b"boom")
        assert status == 500 and b"ValueError('boom')" in text
        assert (await call({}, b"stream"))[0] == 500
        assert (await call({}, b"123456789"))[0] == 413  # past the server's body limit: never handled
        caller = asyncio.ensure_future(call({}, b"hang"))
        await started.wait()
        caller.cancel()  # a rollout's deadline: the handler goes with it
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(cancelled.wait(), 5)

        async def released(request) -> web.Response:  # verifiers cancels a concluded rollout's handlers
            asyncio.current_task().cancel()
            await asyncio.sleep(0)
            return web.Response()

        status, text = await local_route(released, "/v1/chat/completions", 8)({}, b"{}")
        assert status == 503 and b"cancelled" in text

    asyncio.run(scenario())


def test_a_group_takes_its_rollout_slots_at_once_in_the_order_groups_asked():
    """Two groups that each took part of what they need would wait for each other for ever: a group waits until all
    its slots are free, groups are served in the order they asked, and a cancelled wait gives back what it held."""
    async def scenario() -> None:
        slots = RolloutSlots(8)
        order: list[str] = []

        async def group(name: str, n: int, hold: asyncio.Event) -> None:
            async with slots.take(n):
                order.append(name)
                await hold.wait()

        first_done, rest_done = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(group("a6", 6, first_done))
        await asyncio.sleep(0)
        assert slots.free == 2
        waiting = [asyncio.create_task(group(name, n, rest_done)) for name, n in (("b4", 4), ("c2", 2))]
        await asyncio.sleep(0.01)
        assert order == ["a6"] and slots.free == 2  # c2 would fit, but b4 asked first
        first_done.set()
        await asyncio.sleep(0.01)
        assert order == ["a6", "b4", "c2"] and slots.free == 2
        rest_done.set()
        await asyncio.gather(first, *waiting)
        assert slots.free == 8

        async with slots.take(20):  # more than there are: all of them
            assert slots.free == 0
            late = asyncio.create_task(group("d1", 1, rest_done))
            await asyncio.sleep(0.01)
            late.cancel()
            await asyncio.gather(late, return_exceptions=True)
        assert slots.free == 8 and not slots.waiting and order[-1] == "c2"

    asyncio.run(scenario())


def test_one_in_flight_count_shared_by_training_and_eval_moves_with_the_cap():
    """Training's groups and eval's take from the same slots: an eval group queues behind training's; a grown cap
    starts it at once, a trimmed one lets those holding slots finish and starts nothing until they fall below it."""
    from rl.orchestrator.dispatch import Dispatcher

    async def scenario() -> None:
        slots = RolloutSlots(8)
        dispatcher = Dispatcher(slots, 4, [2], runner=None)
        assert dispatcher.capacity == 2
        release = asyncio.Event()

        async def group(n: int) -> None:
            async with slots.take(n):
                await release.wait()

        training = [asyncio.create_task(group(4)) for _ in range(2)]
        await asyncio.sleep(0.01)
        evaluation = asyncio.create_task(group(4))
        await asyncio.sleep(0.01)
        assert slots.free == 0 and len(slots.waiting) == 1  # eval waits for training's slots
        slots.resize(12)
        await asyncio.sleep(0.01)
        assert not slots.waiting and slots.free == 0 and dispatcher.capacity == 3
        slots.resize(4)
        assert slots.free == -8 and dispatcher.capacity == 1
        late = asyncio.create_task(group(4))
        await asyncio.sleep(0.01)
        assert len(slots.waiting) == 1  # over the cap: nothing new starts
        release.set()
        await asyncio.gather(*training, evaluation, late)
        assert slots.free == 4 and not slots.waiting
        with pytest.raises(ValueError, match="at least 1"):
            slots.resize(0)

    asyncio.run(scenario())
