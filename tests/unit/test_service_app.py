"""rl serve-api's REST surface with a stand-in trainer (rl/service/app.py, rl/service/training.py): futures, the
order of a model's requests, and what is refused."""

import asyncio
import contextlib

import pytest
from fastapi.testclient import TestClient

from rl.service.app import Service, build_app
from rl.service.config import ApiConfig, ServiceConfig
from rl.service.training import CallFailed, InOrder

KEY = "tml-unit"


class Trainer:
    """Records the calls; fails the ones named in `fail`."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    async def call(self, op, tensors=None, **settings):
        self.calls.append(op)
        if op in self.fail:
            raise CallFailed(f"{op} failed", "user")
        return {"step": 0, "metrics": {}}, {}


@pytest.fixture
def api(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_API_KEY", KEY)

    with contextlib.ExitStack() as stack:
        def make(trainer):  # one event loop for the client's requests: a future outlives the request that made it
            config = ServiceConfig(model="m", output_dir=tmp_path, api=ApiConfig(long_poll_s=5))
            app = build_app(Service(config, trainer, sampler=None))
            return stack.enter_context(TestClient(app, headers={"X-API-Key": KEY}))
        yield make


def result(client, reply: dict) -> dict:
    return client.post("/api/v1/retrieve_future", json={"request_id": reply["request_id"]}).json()


def session(client) -> str:
    return client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]


def create(client, session="s", seq=0):
    return client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": seq, "base_model": "m",
                                                     "lora_config": {"rank": 4}}).json()


def test_a_model_is_created_through_a_future_named_as_the_sdk_derives_it(api):
    client = api(Trainer())
    reply = create(client)
    assert reply["model_id"] == "s:train:0" and result(client, reply) == {"model_id": "s:train:0",
                                                                          "type": "create_model"}
    info = client.post("/api/v1/get_info", json={"model_id": "s:train:0"}).json()
    assert (info["is_lora"], info["lora_rank"], info["model_data"]["tokenizer_id"]) == (True, 4, "m")


def test_a_model_the_trainer_could_not_make_leaves_room_for_another(api):
    trainer = Trainer(fail={"create_model"})
    client = api(trainer)
    alive = session(client)
    assert result(client, create(client, alive)) == {"error": "create_model failed", "category": "user"}
    trainer.fail.clear()
    assert "error" not in result(client, create(client, alive, seq=1))
    assert create(client, alive, seq=2).get("detail", "").startswith(f"this service already trains {alive}:train:1")


def test_a_model_whose_session_ended_is_replaced_by_the_next_one(api):
    client = api(Trainer())
    first = session(client)
    assert "error" not in result(client, create(client, first))
    assert client.post(f"/api/v1/sessions/{first}/finish", json={"reason": {"type": "success"}}).status_code == 200
    second = session(client)
    assert result(client, create(client, second)) == {"model_id": f"{second}:train:0", "type": "create_model"}


def test_refusals_are_named_with_the_status_the_sdk_expects(api):
    client = api(Trainer())
    assert client.post("/api/v1/create_model", json={"session_id": "s", "model_seq_id": 0,
                                                      "base_model": "other"}).status_code == 400
    unknown = client.post("/api/v1/unload_model", json={})
    assert unknown.status_code == 404 and "unload_model" in unknown.json()["detail"]
    assert client.post("/api/v1/get_info", json={"model_id": "nope"}).status_code == 404
    assert client.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    empty = client.post("/api/v1/forward_backward", content=b"\xff\xff")
    assert empty.status_code == 400 and empty.json()["detail"]  # never a bare 400: the SDK would retry it
    assert client.post("/api/v1/client/config", json={}).json() == {"use_pyqwest_transport": False}


def test_a_call_sent_again_with_its_seq_id_gets_the_first_ones_answer_and_runs_once(api):
    """The SDK sends a call again, with the same seq_id, when it did not read the first answer in time (seen with
    tinker-cookbook's verifiers_rl on a loaded host): the first call's future answers it, the trainer runs it once,
    and an answered future can be read again. A seq_id the service holds nothing for is still refused."""
    trainer = Trainer()
    client = api(trainer)
    model = create(client)["model_id"]
    save = {"model_id": model, "seq_id": 1, "path": "a"}
    first = client.post("/api/v1/save_weights_for_sampler", json=save).json()
    again = client.post("/api/v1/save_weights_for_sampler", json=save).json()
    assert again["request_id"] == first["request_id"]
    answer = result(client, first)
    assert answer == {"path": f"tinker://{model}/sampler_weights/a", "type": "save_weights_for_sampler"}
    assert result(client, again) == answer and trainer.calls.count("save_for_sampler") == 1
    result(client, client.post("/api/v1/save_weights_for_sampler", json=save | {"seq_id": 2}).json())
    stale = client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 0, "adam_params": {}}).json()
    assert "seq_ids must rise" in result(client, stale)["error"]


def test_a_models_requests_run_in_seq_id_order_whatever_order_they_come_in():
    async def scenario():
        order, ran = InOrder(timeout_s=5), []

        async def work(n):
            ran.append(n)
        await asyncio.gather(*(order.run(n, lambda n=n: work(n)) for n in (3, 1, 2)))
        return ran
    assert asyncio.run(scenario()) == [1, 2, 3]


def test_a_request_whose_predecessor_never_comes_fails_by_its_deadline():
    async def scenario():
        order = InOrder(timeout_s=0.05)
        with pytest.raises(CallFailed, match="request 2 waited 0s for request 1"):
            await order.run(2, asyncio.sleep)
    asyncio.run(scenario())


def test_a_saved_policy_loads_once_the_trainer_has_written_it_and_not_before(tmp_path):
    """save_for_sampler is answered before the trainer's writer thread finishes: the servers reload the step only
    once its STABLE marker is there, and a step never written fails by the deadline, named."""
    from rl.protocol import STABLE, RunPaths
    from rl.service.sampler import SampleError, ServedPolicy

    reloaded = []

    class Pool:
        async def update_weights(self, step, path):
            reloaded.append((step, (tmp_path / "weights" / f"step_{step}" / STABLE).is_file()))
            return [{"weights_checksum": "c"}]

    paths = RunPaths(tmp_path)
    served = ServedPolicy(Pool(), paths, timeout_s=0.3)

    async def scenario():
        loading = asyncio.create_task(served.load(1))
        await asyncio.sleep(0.05)
        assert not loading.done()  # waiting for the write
        paths.weights(1).mkdir(parents=True)
        (paths.weights(1) / STABLE).write_text("")
        await loading
        with pytest.raises(SampleError, match="policy 2's weights .* were not written within"):
            await served.load(2)

    asyncio.run(scenario())
    assert reloaded == [(1, True)] and served.step == 1
