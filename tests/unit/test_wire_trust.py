"""What a network peer without the run's secret must not get past on the wire (rl/weights/): a sender that is not
this run's trainer, a header that does not describe the served model, a store or a sender that stalls. Real gloo
groups in threads of this process, as in test_transfer.py; the server's own answers are in
tests/integration/test_server_wire_trust.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import psutil
import pytest
import torch

import rl.inference.staging
import rl.trainer.transfer
from rl.weights.config import CollectiveTransfer
from rl.inference.layout import ServedLayout
from rl.inference.staging import receive_weights
from rl.trainer.transfer import CollectiveSender, collective_sender
from rl.weights import StepRefused, TransferError
from rl.weights.digest import SEAL_BYTES, seal
from rl.weights.group import Deadline, GroupKeeper, broadcast, connect_store, start_store
from rl.weights.offers import GroupSpec
from tests.unit.test_transfer import KEY, SECRET, TinyLM, run_step, single_rank_world

SERVED = ServedLayout(torch.float32, {"model.embed_tokens.weight": (16, 8), "model.proj.weight": (8, 8),
                                      "model.proj.bias": (8,)}, tied=True, adapters=False)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if a receiver allocates the memfd a step's bytes arrive in."""
    def refuse(*args, **kwargs):
        raise AssertionError("a buffer was allocated for a step that should have been refused")

    monkeypatch.setattr(rl.inference.staging.os, "memfd_create", refuse)


def sender_with(tmp_path, secret: str, timeout_s: float = 5.0) -> CollectiveSender:
    config = CollectiveTransfer(backend="gloo", secret=secret, timeout_s=timeout_s, offer_timeout_s=10)
    return collective_sender(config, tmp_path, single_rank_world(), torch.float32, first_step=0)


def test_a_sender_without_the_runs_secret_gets_nothing_allocated_let_alone_served(tmp_path, no_allocation):
    """rl's own sender, keyed with another secret, as an outsider who took rank 0 of a server's group would be: the
    server refuses its header (403) before allocating anything for the step, and drops the group."""
    outsider = sender_with(tmp_path, "not the run's secret at all")
    keeper = GroupKeeper()
    try:
        stats, results = run_step(tmp_path, outsider, TinyLM(), step=1, receivers=1, keepers={1: keeper})
    finally:
        outsider.close()
    assert isinstance(results[1], StepRefused) and results[1].status == 403, results[1]
    assert "not sealed with this run's transfer secret" in str(results[1])
    assert stats["weights_sent"] is False and keeper.group is None


def test_a_checksum_not_sealed_with_the_runs_key_is_refused_though_the_bytes_arrived_intact(tmp_path, monkeypatch):
    """An outsider who replays a sealed header cannot seal the checksum of what it sends: the step is refused."""
    sender = sender_with(tmp_path, SECRET)
    monkeypatch.setattr(rl.trainer.transfer, "checksum_seal", lambda key, header_seal, digest: digest + bytes(32))
    try:
        stats, results = run_step(tmp_path, sender, TinyLM(), step=1, receivers=1)
    finally:
        sender.close()
    assert isinstance(results[1], StepRefused) and results[1].status == 403
    assert "checksum is not sealed" in str(results[1])


def send_header_as(group, step: int, fields: dict, key: bytes = KEY) -> None:
    """A sealed header of the sender's own making (the trainer's fields, changed)."""
    raw = json.dumps({"step": step, "adapter_config": None, "bucket_bytes": 1024, "base": None} | fields).encode()
    data = torch.frombuffer(bytearray(raw + seal(key, "header", raw)), dtype=torch.uint8)
    broadcast(group, torch.tensor([len(data)], dtype=torch.int64), "header length")
    broadcast(group, data, "header")


def receive_what(fields: dict, layout: ServedLayout | None = SERVED) -> Exception:
    """What a receiver makes of a header with `fields`, sent by a rank 0 holding the key."""
    store = start_store("127.0.0.1", 0, 10)
    spec = GroupSpec("127.0.0.1", store.port, 1, 2, 5.0)
    keeper, outcome = GroupKeeper(), {}

    def sender():
        group = keeper.join(store, 1, 0, 2, Deadline(5.0, 1))
        try:
            send_header_as(group, 1, fields)
        finally:
            keeper.done(failed=True)

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        receive_weights(spec, 1, KEY, layout=layout)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome["error"] = e
    thread.join(10)
    assert "error" in outcome, "the receiver took the header"
    return outcome["error"]


@pytest.mark.parametrize("tensors, problem", [
    ([["a", "complex64", [2]]], "dtype 'complex64', which no weight file holds"),
    ([["a", "qint8", [2]]], "dtype 'qint8', which no weight file holds"),
    ([["a", "float32", [-1, 4]]], "gives tensor 'a' the shape [-1, 4]"),
    ([["a", "float32", [2]], ["a", "float32", [2]]], "names tensor 'a' twice"),
    ([["__metadata__", "float32", [2]]], "names a tensor '__metadata__', which no weight file can hold"),
])
def test_a_header_no_weight_file_can_hold_is_refused_before_anything_is_allocated(tensors, problem, no_allocation):
    error = receive_what({"tensors": tensors}, layout=None)
    assert isinstance(error, StepRefused) and error.status == 400 and problem in str(error), error


def test_a_header_that_is_not_the_served_model_is_refused_before_anything_is_allocated(no_allocation):
    """A 1 GiB tensor the served model does not have, a float16 step for a float32 server, a missing tensor, an
    adapter for a server of full weights: each refused on its header, nothing allocated for its bytes."""
    served = [[name, "float32", list(shape)] for name, shape in SERVED.shapes.items()]
    cases = [
        (served + [["model.extra.weight", "float32", [2**14, 2**14]]], "not served: model.extra.weight"),
        ([[n, "float16", s] for n, _, s in served], "holds tensors of torch.float16, but this server serves "
                                                     "torch.float32"),
        (served[1:], "not in the files: model.embed_tokens.weight"),
    ]
    for tensors, problem in cases:
        error = receive_what({"tensors": tensors})
        assert isinstance(error, StepRefused) and problem in str(error), error
    error = receive_what({"tensors": served, "adapter_config": "{}"})
    assert isinstance(error, StepRefused) and "is a LoRA adapter, but this server serves full weights" in str(error)


def test_an_adapter_header_must_be_lora_matrices_no_larger_than_the_served_model(no_allocation):
    lora = ServedLayout(torch.float32, SERVED.shapes, tied=True, adapters=True)
    adapter = {"adapter_config": "{}"}
    cases = [
        ({"tensors": [["model.proj.weight", "float32", [8, 8]]]}, "no LoRA matrix"),
        ({"tensors": [["x.lora_A.weight", "float32", [2**20, 8]]]}, "bytes of adapter, more than the served model's"),
        ({"tensors": [["x.lora_A.weight", "float32", [2, 8]]], "adapter_config": None}, "holds full weights"),
    ]
    for fields, problem in cases:
        error = receive_what(adapter | fields, layout=lora)
        assert isinstance(error, StepRefused) and problem in str(error), error


def test_a_store_that_accepts_and_never_answers_holds_a_step_no_longer_than_its_deadline():
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="accepted the connection but never answered"):
            connect_store("127.0.0.1", silent.getsockname()[1], Deadline(1.5, 1))
        assert time.monotonic() - start < 3.0
    finally:
        silent.close()


def test_a_sender_that_paces_its_buckets_cannot_stretch_a_step_past_its_deadline(tmp_path, monkeypatch):
    """Every broadcast within its own time, but the step as a whole past `timeout_s`: the receiver gives up at the
    step's deadline, not at a deadline per broadcast."""
    monkeypatch.setattr(rl.trainer.transfer, "BUCKET_BYTES", 64)  # a broadcast per tensor: 4 of them
    start_one = rl.trainer.transfer.start_broadcast

    def paced(group, tensor, what):
        time.sleep(0.6)
        return start_one(group, tensor, what)

    monkeypatch.setattr(rl.trainer.transfer, "start_broadcast", paced)
    sender = sender_with(tmp_path, SECRET, timeout_s=3)
    try:  # with a deadline per broadcast (0.6 s each, 1 s allowed) the step would have loaded
        _, results = run_step(tmp_path, sender, TinyLM(), step=1, receivers=1, timeout_s=1.0)
    finally:
        sender.close()
    assert isinstance(results[1], TransferError) and "ran out of its 1 s" in str(results[1]), results[1]


def test_the_store_listens_on_transfer_host_only():
    store = start_store("127.0.0.1", 0, 5)
    listening = [c.laddr.ip for c in psutil.net_connections("tcp")
                 if c.status == "LISTEN" and c.laddr.port == store.port]
    assert listening == ["127.0.0.1"], listening


def test_the_seal_is_keyed_and_bound_to_what_it_seals():
    assert seal(KEY, "header", b"x") != seal(bytes(SEAL_BYTES), "header", b"x")
    assert seal(KEY, "header", b"x") != seal(KEY, "checksum", b"x")
    assert len(seal(KEY, "header", b"x")) == SEAL_BYTES
