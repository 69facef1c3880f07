"""Trust round 4 against a real server taking steps over gloo (rl/weights/): an outsider without the run's secret
in rank 0's place of the server's group, again and again with the run's trainer between its tries; a store that
never answers; a step that is not newer; a header of another dtype; a stop while a receive waits on a silent peer."""

from __future__ import annotations

import signal
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from rl.weights.config import CollectiveTransfer
from rl.trainer.transfer import CollectiveSender, collective_sender
from tests.integration.inference_server import Server
from tests.integration.test_inference_tp import send_over_the_wire
from tests.unit.test_transfer import single_rank_world

pytestmark = pytest.mark.integration
SECRET = "the secret of this module's run"
WIRE = f'[transfer]\nbackend = "gloo"\nsecret = "{SECRET}"\n'


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("wire_trust")
    (root / "weights").mkdir()
    started = Server(tiny_model, root / "weights", root / "inference.log", toml=WIRE)
    yield started
    started.stop()


def sender(wire_dir, secret: str, timeout_s: float = 10) -> CollectiveSender:
    config = CollectiveTransfer(backend="gloo", secret=secret, timeout_s=timeout_s, offer_timeout_s=60)
    return collective_sender(config, wire_dir, single_rank_world(), torch.float32, first_step=0)


def weights(tiny_model, scale: float = 1.0, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(name, (tensor * scale).to(dtype)) for name, tensor in load_file(tiny_model / "model.safetensors").items()]


def served(server) -> dict:
    return server.admin("GET", "/policy_step").json()


def test_an_outsider_in_rank_0s_place_never_gets_its_weights_served(server, tiny_model, tmp_path):
    """The strongest place the race for rank 0 can give an outsider: the server's group formed with it as rank 0.
    It uses rl's own sender with a secret of its own (it holds not the run's) and sends a model whose weights are all
    zero. Four tries, the run's trainer sending a step between each (so the group is formed anew every time): every
    try is refused (403) and the server keeps serving what the trainer sent last; every step of the trainer's loads."""
    trainer, outsider = sender(tmp_path / "trainer", SECRET), sender(tmp_path / "outsider", "an outsider's guess", 5)
    try:
        step = served(server)["step"]
        for attempt in range(4):
            before = served(server)
            step += 1
            answer, sent = send_over_the_wire(server, outsider, tmp_path / "outsider", step, weights(tiny_model, 0.0))
            assert answer.status_code == 403, answer.text
            assert "not sealed with this run's transfer secret" in answer.text
            assert sent["weights_sent"] is False and served(server) == before, attempt
            step += 1
            answer, sent = send_over_the_wire(server, trainer, tmp_path / "trainer", step,
                                              weights(tiny_model, 1.0 + attempt / 100))
            assert answer.status_code == 200, answer.text
            assert answer.json()["weights_checksum"] == sent["weights_checksum"] == served(server)["weights_checksum"]
    finally:
        trainer.close()
        outsider.close()


def update_over_the_wire(server, step: int, port: int, timeout_s: float):
    spec = {"host": "127.0.0.1", "port": port, "rank": 1, "world_size": 2, "timeout_s": timeout_s}
    start = time.monotonic()
    answer = server.admin("POST", "/update_weights", json={"step": step, "transfer": spec})
    return answer, time.monotonic() - start


def test_a_store_that_never_answers_and_a_closed_port_are_answered_within_the_steps_deadline(server):
    silent = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        step = served(server)["step"] + 1
        for port, why in ((silent.getsockname()[1], "never answered"), (closed_port, "")):
            answer, took = update_over_the_wire(server, step, port, timeout_s=3)
            assert answer.status_code == 504 and why in answer.text, answer.text
            assert took < 3 + 2, took
    finally:
        silent.close()


def test_a_stale_rank_0_address_in_the_store_holds_the_server_no_longer_than_the_steps_deadline(server):
    """Trust round 5: a store client writes an address of rank 0 that no one listens behind, one the server waits to
    be connected from (gloo alone held it ~5x the step's timeout). The server answers by the step's deadline,
    naming the group that did not form and why, and keeps serving."""
    import threading

    from rl.weights.group import NOTHING_HELD, start_store
    from tests.unit.test_wire_deadlines import moved

    store = start_store("127.0.0.1", 0, 30)
    before = served(server)
    step = before["step"] + 1
    store.set(f"step_{step}/holds/0", NOTHING_HELD)  # as the trainer holding no group reports
    outcome = {}
    asking = threading.Thread(target=lambda: outcome.update(answer=update_over_the_wire(server, step, store.port, 3)))
    asking.start()
    published = store.get(f"step_{step}/group/0/1")  # once the server published where it listens
    store.set(f"step_{step}/group/0/0", moved(published, 65535))
    asking.join(60)
    answer, took = outcome["answer"]
    assert took < 3 + 2, took
    assert answer.status_code == 504, answer.text
    assert "did not form within 3 s" in answer.text and "not every member connected" in answer.text, answer.text
    assert served(server) == before


def test_a_step_that_is_not_newer_is_refused_before_the_store_is_reached(server):
    nobody = socket.create_server(("127.0.0.1", 0))  # it would never answer: a refusal must not wait for it
    try:
        answer, took = update_over_the_wire(server, served(server)["step"], nobody.getsockname()[1], timeout_s=30)
    finally:
        nobody.close()
    assert answer.status_code == 409 and "is not newer than the served step" in answer.text, answer.text
    assert took < 2, took


def test_a_sealed_step_of_another_dtype_is_refused_on_its_header(server, tiny_model, tmp_path):
    trainer = sender(tmp_path, SECRET)
    trainer.dtype = torch.float16  # as a trainer configured for another server would send
    try:
        before = served(server)
        answer, _ = send_over_the_wire(server, trainer, tmp_path, before["step"] + 1,
                                       weights(tiny_model, dtype=torch.float16))
    finally:
        trainer.close()
    assert answer.status_code == 400 and "holds tensors of torch.float16, but this server serves torch.float32" \
        in answer.text, answer.text
    assert served(server) == before


def test_a_server_stopped_while_a_receive_waits_on_a_silent_peer_exits_within_its_grace(tiny_model, tmp_path):
    import threading

    (tmp_path / "weights").mkdir()
    server = Server(tiny_model, tmp_path / "weights", tmp_path / "inference.log", toml=WIRE)
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        waiting = threading.Thread(target=update_over_the_wire, args=(server, 1, silent.getsockname()[1], 600))
        waiting.start()
        time.sleep(1.0)  # the receive is waiting on the silent store's handshake
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        took = time.monotonic() - start
        assert took < 5 + 5, f"a SIGTERMed server took {took:.1f} s to exit (its grace is 5 s)"
        waiting.join(30)
    finally:
        silent.close()
        server.stop()
