"""Weights over the wire (rl/weights/): the trainer's sender and the servers' receivers over a real gloo group in
one process (threads), with the orchestrator's part (the take) played by the test."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl.weights.config import CollectiveTransfer
from rl.inference.staging import WIRE_FILE, receive_weights
from rl.manifest import CorruptFileError
from rl.safetensors_io import tensors_of
from rl.trainer.transfer import CollectiveSender, GlooSender, collective_sender
from rl.weights.group import Deadline, GroupKeeper
from rl.weights.offers import GroupSpec, offered_steps, read_offer, write_take
from rl.weights import TransferError
from rl.trainer.weights import TIED_HEAD
from rl.weights.digest import transfer_key

SECRET = "a secret of this test run"  # the run's transfer.secret; its key seals every step
KEY = transfer_key(SECRET)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)

    def state_dict(self, *args, **kwargs):  # names as a Hugging Face causal LM's, the embedding tied
        return {"model.embed_tokens.weight": self.embed_tokens.weight, "model.proj.weight": self.proj.weight,
                "model.proj.bias": self.proj.bias}


def single_rank_world():
    return SimpleNamespace(is_main=True, rank=0, world_size=1, all_reduce=lambda values, op="sum": values)


def staged_tensors(staged) -> dict[str, torch.Tensor]:
    fd, size = staged.files[WIRE_FILE]
    with mmap.mmap(os.dup(fd), size, access=mmap.ACCESS_COPY) as data:
        return {name: tensor.clone() for name, tensor in tensors_of(data, WIRE_FILE)}


def run_step(tmp_path, sender, model, step, receivers, corrupt=None, timeout_s=10.0, keepers=None, bases=None,
             formed_at=None):
    """Offer `step`, take it for `receivers` servers, receive it in threads (each in its group kept in `keepers`, by
    rank, where given; each serving the step received in `bases`, by rank, where given; the steps whose group each
    formed appended to `formed_at`, by rank, where given); returns the sender's stats and each receiver's `Received`
    or exception."""
    results: dict[int, object] = {}
    stats = {}

    def send():
        stats.update(sender.send(step, model))

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 10
    while step not in offered_steps(tmp_path):
        assert time.monotonic() < deadline, "the sender never offered the step"
        time.sleep(0.01)
    offer = read_offer(tmp_path, step)
    write_take(tmp_path, step, receivers)

    def receive(rank):
        spec = GroupSpec(offer.host, offer.port, rank, receivers + 1, timeout_s)
        try:
            base = (bases or {}).get(rank)
            results[rank] = receive_weights(spec, step, KEY, keeper=(keepers or {}).get(rank),
                                            base=base and base.staged.rpc(),
                                            forming=formed_at and recording_into(formed_at[rank]))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[rank] = e

    threads = [threading.Thread(target=receive, args=(rank,), name=f"receiver {rank}")
               for rank in range(1, receivers + 1)]
    with altered_for_receiver_1(corrupt):
        for t in threads:
            t.start()
        for t in threads + [thread]:
            t.join(60)
            assert not t.is_alive(), "a transfer thread hung"
    return stats, results


@contextlib.contextmanager
def altered_for_receiver_1(name: str | None):
    """Receiver 1 (its thread) hashes what lands with a digest that first alters tensor `name`, as a fault on the
    way would (`hooks.AlteredOnArrival`); the others, and every receiver where `name` is None, with the plain one."""
    from unittest import mock

    from rl.inference import hooks
    from rl.weights.digest import TensorDigest

    def digest():
        altered = name is not None and threading.current_thread().name == "receiver 1"
        return hooks.AlteredOnArrival(name) if altered else TensorDigest()

    with mock.patch.object(hooks, "received_digest", digest):
        yield


def recording_into(steps: list[int]):
    """A `forming` context (GroupKeeper.join) that records the step whose group forms inside it."""
    @contextlib.contextmanager
    def forming(deadline):
        steps.append(deadline.step)
        yield

    return forming


def one_rank_sender(tmp_path, sparse: bool):
    config = CollectiveTransfer(backend="gloo", sparse=sparse, secret=SECRET, timeout_s=5, offer_timeout_s=10)
    sender = collective_sender(config, tmp_path, single_rank_world(), torch.float32, first_step=0)
    yield sender
    sender.close()


@pytest.fixture
def sender(tmp_path):
    yield from one_rank_sender(tmp_path, sparse=False)


def test_every_server_receives_the_step_bit_for_bit_with_the_trainers_checksum(tmp_path, sender):
    model = TinyLM()
    stats, results = run_step(tmp_path, sender, model, step=1, receivers=2)
    assert stats["weights_sent"] is True
    expected = dict(model.state_dict()) | {TIED_HEAD: model.embed_tokens.weight}
    for rank in (1, 2):
        staged, checksum = results[rank].staged, results[rank].checksum
        try:
            assert checksum == stats["weights_checksum"] and results[rank].adapter_config is None
            received = staged_tensors(staged)
            assert list(received) == list(expected)  # the order the checksum hashes
            for name, tensor in expected.items():
                assert torch.equal(received[name], tensor.detach()), name
        finally:
            staged.close()


def test_a_step_altered_on_the_way_is_refused_by_the_server_that_got_it(tmp_path, sender):
    stats, results = run_step(tmp_path, sender, TinyLM(), step=1, receivers=2, corrupt="model.proj.weight")
    assert isinstance(results[1], CorruptFileError)
    assert "arrived altered" in str(results[1]) and stats["weights_checksum"] in str(results[1])
    results[2].staged.close()  # the other server got it intact
    assert results[2].checksum == stats["weights_checksum"]


def test_the_group_is_formed_once_and_kept_while_every_member_holds_it_and_formed_anew_when_one_does_not(
    tmp_path, sender
):
    """Forming a group costs every member a rendezvous, so it is kept from step to step; a member that restarted (a
    new keeper), another set of receivers, or a failed step makes all form a new one, and every step goes through."""
    keepers, formed_at = {1: GroupKeeper(), 2: GroupKeeper()}, {1: [], 2: []}

    def step_through(step, receivers=2):
        stats, results = run_step(tmp_path, sender, TinyLM(), step, receivers, keepers=keepers, formed_at=formed_at)
        assert stats["weights_sent"] is True, step
        for rank in range(1, receivers + 1):
            results[rank].staged.close()
            assert results[rank].checksum == stats["weights_checksum"]

    for step in (1, 2, 3):
        step_through(step)
    assert [sender.groups.formed, keepers[1].formed, keepers[2].formed] == [1, 1, 1]
    kept = sender.groups.group

    keepers[2] = GroupKeeper()  # server 2 restarted
    step_through(4)
    assert [sender.groups.formed, keepers[1].formed, keepers[2].formed] == [2, 2, 1]
    assert sender.groups.group is not kept
    step_through(5)
    assert sender.groups.formed == 2

    step_through(6, receivers=1)  # the orchestrator asked one server only
    step_through(7, receivers=1)
    assert [sender.groups.formed, keepers[1].formed] == [3, 3]

    stats, results = run_step(tmp_path, sender, TinyLM(), 8, 1, keepers=keepers, corrupt="model.proj.weight")
    assert isinstance(results[1], CorruptFileError)  # refused by the server; the group itself served, and is kept
    step_through(9, receivers=1)
    assert sender.groups.formed == 3
    assert formed_at == {1: [1, 4, 6], 2: [1, 4]}  # a server forms only inside `forming` (generation held there)


def test_a_group_kept_by_a_trainer_that_resumed_is_never_taken_for_the_new_trainers(tmp_path):
    """A resumed trainer starts a new store with a new run token, so the groups it forms have other names than those
    the servers still hold. Here server 1 holds the old trainer's group formed at step 1, at rank 1 of 2, and the
    resumed trainer formed its own group at step 1 too (with another server, at the same ranks): by step and ranks
    alone the two would pass for one, and server 1 would wait on a trainer that is gone."""
    config = CollectiveTransfer(backend="gloo", secret=SECRET, timeout_s=5, offer_timeout_s=10)
    old_group, new_group = {1: GroupKeeper()}, {1: GroupKeeper()}

    def step_through(sender, step, keepers):
        stats, results = run_step(tmp_path, sender, TinyLM(), step, 1, keepers=keepers)
        assert stats["weights_sent"] is True and results[1].checksum == stats["weights_checksum"]
        results[1].staged.close()

    old = collective_sender(config, tmp_path, single_rank_world(), torch.float32, first_step=0)
    step_through(old, 1, old_group)
    old.close()
    resumed = collective_sender(config, tmp_path, single_rank_world(), torch.float32, first_step=1)
    try:
        step_through(resumed, 1, new_group)
        step_through(resumed, 2, old_group)  # server 1 again
    finally:
        resumed.close()
    assert old_group[1].formed == 2


def test_a_kept_group_serves_one_step_at_a_time(tmp_path, sender):
    keeper = GroupKeeper()
    keeper.busy.acquire()  # a receive of another step is still running
    with pytest.raises(TransferError, match="cannot be transferred while another step's transfer is in progress"):
        keeper.join(None, 3, 1, 2, Deadline(1.0, 3))


def test_small_tensors_share_broadcasts_and_a_big_one_goes_alone():
    from rl.weights.header import bucket_plan

    assert bucket_plan([10, 100, 10, 10, 50, 0], 64) == [(0, 1), (1, 2), (2, 4), (4, 6)]
    assert bucket_plan([10, 20], 64) == [(0, 2)]
    assert bucket_plan([], 64) == []
    assert bucket_plan([5, 5], 0) == [(0, 1), (1, 2)]  # a bucket of 0 bytes: one tensor per broadcast


def test_tensors_sent_in_buckets_arrive_bit_for_bit_and_an_altered_one_inside_a_bucket_is_refused(
    tmp_path, sender, monkeypatch
):
    """With buckets smaller than the model: the embedding (512 bytes) alone, the projection's weight and bias
    together, the head alone; every tensor lands in its place, and a byte altered in the shared bucket is caught."""
    import rl.trainer.transfer

    monkeypatch.setattr(rl.trainer.transfer, "BUCKET_BYTES", 300)
    model = TinyLM()
    stats, results = run_step(tmp_path, sender, model, step=1, receivers=2, corrupt="model.proj.bias")
    assert isinstance(results[1], CorruptFileError) and "arrived altered" in str(results[1])
    staged, checksum = results[2].staged, results[2].checksum
    try:
        assert checksum == stats["weights_checksum"]
        expected = dict(model.state_dict()) | {TIED_HEAD: model.embed_tokens.weight}
        received = staged_tensors(staged)
        assert list(received) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(received[name], tensor.detach()), name
    finally:
        staged.close()


def test_each_bucket_goes_on_its_way_while_the_next_is_gathered_and_buckets_are_packed_in_two_kept_buffers(
    tmp_path, sender, monkeypatch
):
    """The trainer gathers, packs and hashes the next bucket while the last one is broadcast (waited on only before the
    next starts), and packs small tensors into the same two buffers from bucket to bucket and step to step; a server
    receives the next bucket into its place while it hashes the one that arrived."""
    import rl.trainer.transfer
    from rl.weights.group import InFlight

    monkeypatch.setattr(rl.trainer.transfer, "BUCKET_BYTES", 300)  # the embedding, then weight and bias, then head
    events = []
    gather, wait = CollectiveSender._gather, InFlight.wait

    def logged_gather(self, source):
        events.append(("gather", tuple(source.shape)))
        return gather(self, source)

    def logged_wait(self):
        if self.group.process_group.rank() == 0:  # the trainer's waits, not the receivers'
            events.append(("wait", self.what))
        return wait(self)

    import rl.inference.staging

    start, land = rl.inference.staging.start_broadcast, rl.inference.staging._land

    def logged_start(group, tensor, what):  # the receiver's
        events.append(("receive", what))
        return start(group, tensor, what)

    def logged_land(in_flight, *args):
        events.append(("hash", in_flight.what))
        return land(in_flight, *args)

    monkeypatch.setattr(CollectiveSender, "_gather", logged_gather)
    monkeypatch.setattr(InFlight, "wait", logged_wait)
    monkeypatch.setattr(rl.inference.staging, "start_broadcast", logged_start)
    monkeypatch.setattr(rl.inference.staging, "_land", logged_land)
    buffers = []
    for step in (1, 2):
        events.clear()
        stats, results = run_step(tmp_path, sender, TinyLM(), step=step, receivers=1)
        assert results[1].checksum == stats["weights_checksum"]
        results[1].staged.close()
        assert events.index(("gather", (8,))) < events.index(("wait", f"model.embed_tokens.weight of step {step}"))
        assert events.index(("gather", (16, 8)), 1) < events.index(
            ("wait", f"2 tensors (model.proj.weight to model.proj.bias) of step {step}"))
        # the server receives the next bucket into its place while it hashes the one that arrived
        pair = f"2 tensors (model.proj.weight to model.proj.bias) of step {step}"
        assert events.index(("receive", pair)) < events.index(("hash", f"model.embed_tokens.weight of step {step}"))
        buffers.append([buffer.data_ptr() for buffer in sender.staging])
    assert buffers[0] == buffers[1]


def test_a_server_that_never_joins_fails_the_step_within_the_deadline_and_the_next_step_goes_through(
    tmp_path, sender
):
    start = time.monotonic()
    stats, results = run_step(tmp_path, sender, TinyLM(), step=1, receivers=1, timeout_s=5)
    assert stats["weights_sent"] is True  # both members joined: the group was one receiver
    results[1].staged.close()

    # the orchestrator announces two receivers but only one comes: everybody gives up within timeout_s
    results2: dict = {}
    thread = threading.Thread(target=lambda: results2.update(sender.send(2, TinyLM())))
    thread.start()
    while 2 not in offered_steps(tmp_path):
        time.sleep(0.01)
    offer = read_offer(tmp_path, 2)
    write_take(tmp_path, 2, 2)
    start = time.monotonic()
    with pytest.raises(TransferError, match="did not all report within 2 s"):
        receive_weights(GroupSpec(offer.host, offer.port, 1, 3, 2.0), 2, KEY)
    thread.join(30)
    assert not thread.is_alive()
    assert results2["weights_sent"] is False and "weights_checksum" not in results2
    assert time.monotonic() - start < 15

    stats, results = run_step(tmp_path, sender, TinyLM(), step=3, receivers=1)
    assert stats["weights_sent"] is True
    results[1].staged.close()


def test_a_server_asked_for_another_step_refuses_what_the_trainer_sends(tmp_path, sender):
    thread = threading.Thread(target=lambda: sender.send(4, TinyLM()))
    thread.start()
    while 4 not in offered_steps(tmp_path):
        time.sleep(0.01)
    offer = read_offer(tmp_path, 4)
    write_take(tmp_path, 4, 1)
    with pytest.raises(TransferError, match="asked to receive step 5, but the trainer sends step 4"):
        # the group of step 4's keys, joined by a server that was asked for step 5
        receive_weights_as(GroupSpec(offer.host, offer.port, 1, 2, 5.0), group_step=4, asked_step=5)
    thread.join(30)
    assert not thread.is_alive()


def receive_weights_as(spec: GroupSpec, group_step: int, asked_step: int):
    from rl.weights.group import Deadline, GroupKeeper, connect_store
    from rl.weights.header import receive_header

    keeper = GroupKeeper()
    deadline = Deadline(spec.timeout_s, asked_step)
    group = keeper.join(connect_store(spec.host, spec.port, deadline), group_step, spec.rank, spec.world_size, deadline)
    try:
        receive_header(group, asked_step, KEY)
    finally:
        keeper.done(failed=True)


def test_the_trainer_gives_up_on_an_offer_nobody_takes(tmp_path):
    config = CollectiveTransfer(backend="gloo", secret=SECRET, timeout_s=5, offer_timeout_s=0.5)
    sender = collective_sender(config, tmp_path, single_rank_world(), torch.float32, first_step=0)
    with pytest.raises(TransferError, match="waited 0 s for the orchestrator to take the weights of step 1"):
        sender.send(1, TinyLM())


def test_an_adapter_arrives_with_its_config_and_is_written_as_a_checked_private_copy(tmp_path):
    from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from rl.inference.staging import PrivateCopies
    from rl.listed_files import read_listed

    config = b'{"peft_type": "LORA", "r": 2}'
    wire = CollectiveTransfer(backend="gloo", secret=SECRET, timeout_s=5, offer_timeout_s=10)
    sender = collective_sender(wire, tmp_path, single_rank_world(), torch.float32, first_step=0, adapter_config=config)
    adapter = {"base_model.model.q_proj.lora_A.weight": torch.randn(2, 8),
               "base_model.model.q_proj.lora_B.weight": torch.zeros(8, 2)}

    class AdapterSender:  # what the trainer's gather of the adapter gives: whole tensors on every rank
        def send(self, step, _model):
            return sender.send_tensors(step, list(adapter.items()))

    stats, results = run_step(tmp_path, AdapterSender(), None, step=0, receivers=1)
    received = results[1]
    assert received.adapter_config == config.decode() and received.checksum == stats["weights_checksum"]
    copies = PrivateCopies()
    try:
        copy, manifest = copies.write_adapter(received, 0)
        assert read_listed(Path(copy), ADAPTER_CONFIG, manifest[ADAPTER_CONFIG]) == config
        weights = read_listed(Path(copy), ADAPTER_WEIGHTS, manifest[ADAPTER_WEIGHTS])  # size and CRC-32 checked
        assert {n: t.clone() for n, t in tensors_of(weights, ADAPTER_WEIGHTS)}.keys() == adapter.keys()
        assert stats["adapter_checksum"]
    finally:
        received.staged.close()
        copies.close()


def test_nccl_is_refused_where_there_is_no_gpu_naming_gloo():
    from rl.config import ConfigError

    with pytest.raises(ConfigError, match="'nccl' needs CUDA GPUs, but the inference runs on cpu: use 'gloo'"):
        CollectiveTransfer(backend="nccl").resolve_device("cpu", "inference")
    assert CollectiveTransfer(backend="nccl").resolve_device("cuda", "trainer") == "set by you"
    with pytest.raises(ConfigError, match="'nccl' needs CUDA GPUs, but the trainer runs on cpu: use 'gloo'"):
        CollectiveTransfer(backend="nccl", sparse=True).resolve_device("cpu", "trainer")
    with pytest.raises(TransferError, match="needs the trainer on CUDA GPUs"):
        collective_sender(CollectiveTransfer(backend="nccl", secret=SECRET), Path("unused"),
                         SimpleNamespace(is_main=True, on_gpu=False, device=torch.device("cpu")), torch.float32, 0)


NCCL_RECEIVER = """
import sys, torch
from rl.inference.staging import receive_weights
from rl.weights.digest import transfer_key
from rl.weights.group import GroupKeeper
from rl.weights.offers import GroupSpec
torch.cuda.set_device(1)
host, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3]
keeper, served = GroupKeeper(), None
for step in (1, 2):  # the step received last is what this receiver serves (the base of a sparse step)
    received = receive_weights(GroupSpec(host, port, 1, 2, 60.0), step, transfer_key(secret), backend="nccl",
                               keeper=keeper, base=served and served.staged.rpc())
    print("checksum", step, received.checksum, flush=True)
    if served is not None:
        served.staged.close()
    served = received
print("formed", keeper.formed)
keeper.drop()
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL will not join two ranks on one GPU")
@pytest.mark.parametrize("sparse", [False, True])
def test_over_nccl_a_step_leaves_the_trainers_gpu_and_arrives_in_the_servers_with_the_trainers_checksum(tmp_path,
                                                                                                      sparse):
    """The GPU path of rl.weights: the trainer's sender broadcasts from cuda:0 over NCCL, a receiver process on
    cuda:1 (as a server's first worker) gets it into its GPU and stages it; both hash the same bytes. The NCCL group
    formed for the first step carries the second; sparse, the second goes as its changes."""
    import subprocess
    import sys

    world = SimpleNamespace(is_main=True, rank=0, world_size=1, on_gpu=True, device=torch.device("cuda", 0),
                            all_reduce=lambda values, op="sum": values)
    torch.cuda.set_device(0)
    wire = CollectiveTransfer(backend="nccl", sparse=sparse, secret=SECRET, timeout_s=60, offer_timeout_s=60)
    sender = collective_sender(wire, tmp_path, world, torch.bfloat16, first_step=0)
    model = TinyLM().cuda()
    stats: dict = {}

    def send():
        for step in (1, 2):
            stats[step] = sender.send(step, model)
            with torch.no_grad():
                model.proj.weight += 1  # the next step's weights differ

    thread = threading.Thread(target=send)
    thread.start()
    receiver = None
    try:
        for step in (1, 2):
            deadline = time.monotonic() + 120
            while step not in offered_steps(tmp_path):
                assert time.monotonic() < deadline, f"step {step} was never offered"
                time.sleep(0.01)
            offer = read_offer(tmp_path, step)
            write_take(tmp_path, step, 1)
            if receiver is None:
                receiver = subprocess.Popen([sys.executable, "-c", NCCL_RECEIVER, offer.host, str(offer.port), SECRET],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = receiver.communicate(timeout=300)
        thread.join(120)
    finally:
        if receiver is not None and receiver.poll() is None:
            receiver.kill()
        sender.close()
    assert receiver.returncode == 0, err[-3000:]
    assert all(stats[step]["weights_sent"] is True for step in (1, 2))
    checksums = {int(line.split()[1]): line.split()[2] for line in out.splitlines() if line.startswith("checksum")}
    assert checksums == {step: stats[step]["weights_checksum"] for step in (1, 2)}
    assert checksums[1] != checksums[2]
    assert "formed 1" in out and sender.groups.formed == 1
    assert [stats[step]["transfer_sparse"] for step in (1, 2)] == [False, sparse]


def changed_a_little(model: TinyLM) -> None:
    """What a small optimizer step does to bf16 weights: a few elements change, most keep their bits."""
    with torch.no_grad():
        model.proj.weight[2, 3] += 0.5
        model.embed_tokens.weight[7] += 0.25  # a row: the tied head changes the same way


def expect_served(model: TinyLM, received) -> None:
    expected = dict(model.state_dict()) | {TIED_HEAD: model.embed_tokens.weight}
    tensors = staged_tensors(received.staged)
    assert list(tensors) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor.detach()), name


@pytest.fixture
def sparse_sender(tmp_path):
    yield from one_rank_sender(tmp_path, sparse=True)


def close_all(*results) -> None:
    for received in results:
        if hasattr(received, "staged"):
            received.staged.close()


@pytest.mark.parametrize("bucket_bytes", [None, 300], ids=["one bucket", "three buckets"])
def test_a_sparse_step_sends_only_what_changed_and_each_server_serves_the_whole_step_with_the_trainers_checksum(
    tmp_path, sparse_sender, monkeypatch, bucket_bytes
):
    """Three buckets: the embedding alone, the projection's weight and bias together, the head alone; each applied
    while the next arrives."""
    import rl.trainer.transfer

    if bucket_bytes is not None:
        monkeypatch.setattr(rl.trainer.transfer, "BUCKET_BYTES", bucket_bytes)
    model = TinyLM()
    stats, first = run_step(tmp_path, sparse_sender, model, step=1, receivers=2)
    whole = sum(t.numel() * 4 for t in model.state_dict().values()) + model.embed_tokens.weight.numel() * 4
    assert stats["transfer_sparse"] is False and stats["transfer_bytes"] == whole  # no server serves a sent step yet
    changed_a_little(model)
    stats, second = run_step(tmp_path, sparse_sender, model, step=2, receivers=2, bases=first)
    try:
        assert stats["weights_sent"] and stats["transfer_sparse"] is True
        assert stats["transfer_bytes"] == (1 + 8 + 8) * (4 + 4)  # index and value of each changed element
        for rank in (1, 2):
            assert second[rank].checksum == stats["weights_checksum"]
            expect_served(model, second[rank])
        changed_a_little(model)  # and again, against the step just received
        stats, third = run_step(tmp_path, sparse_sender, model, step=3, receivers=2, bases=second)
        assert stats["transfer_sparse"] is True and all(third[r].checksum == stats["weights_checksum"] for r in (1, 2))
        expect_served(model, third[1])
        close_all(*third.values())
    finally:
        close_all(*first.values(), *second.values())


def test_a_step_goes_whole_to_all_when_one_server_does_not_serve_the_step_sent_last(tmp_path, sparse_sender):
    """A server that refused a step, restarted or caught up from files serves other weights: the changes would not
    apply to them, so the next step goes whole to every server, and each serves it."""
    model = TinyLM()
    _, first = run_step(tmp_path, sparse_sender, model, step=1, receivers=2)
    changed_a_little(model)
    try:
        stats, second = run_step(tmp_path, sparse_sender, model, step=2, receivers=2, bases={1: first[1]})
        assert stats["weights_sent"] and stats["transfer_sparse"] is False
        for rank in (1, 2):
            assert second[rank].checksum == stats["weights_checksum"]
            expect_served(model, second[rank])
        close_all(*second.values())
    finally:
        close_all(*first.values())


def test_sparse_changes_altered_on_the_way_are_refused(tmp_path, sparse_sender, monkeypatch):
    """A changed element altered (the test hook flips a byte once applied), or an index outside its tensor: the
    server that got it refuses the step after receiving it whole; the other serves it."""
    import rl.trainer.transfer

    model = TinyLM()
    _, first = run_step(tmp_path, sparse_sender, model, step=1, receivers=2)
    changed_a_little(model)
    stats, second = run_step(tmp_path, sparse_sender, model, step=2, receivers=2, bases=first,
                             corrupt="model.proj.weight")
    assert stats["transfer_sparse"] is True
    assert isinstance(second[1], CorruptFileError) and "arrived altered" in str(second[1])
    assert second[2].checksum == stats["weights_checksum"]
    expect_served(model, second[2])

    encode = rl.trainer.transfer.encode_changes

    def beyond_the_tensor(now, before, itemsize):
        count, data = encode(now, before, itemsize)
        if count > 0:
            data = data.clone()
            data[:4] = torch.tensor([10**6], dtype=torch.int32).view(torch.uint8)
        return count, data

    monkeypatch.setattr(rl.trainer.transfer, "encode_changes", beyond_the_tensor)
    bases = {1: second[2], 2: second[2]}
    changed_a_little(model)
    stats, third = run_step(tmp_path, sparse_sender, model, step=3, receivers=2, bases=bases)
    try:
        assert stats["transfer_sparse"] is True
        for rank in (1, 2):
            assert isinstance(third[rank], CorruptFileError), third[rank]
            assert "names element" in str(third[rank]) and "arrived altered" in str(third[rank])
    finally:
        close_all(*first.values(), *second.values(), *third.values())


def test_changes_are_encoded_bit_for_bit_and_go_whole_where_that_is_smaller():
    from rl.weights.sparse import WHOLE, apply_changes, encode_changes
    from rl.weights.digest import tensor_bytes

    before = torch.randn(1000).to(torch.bfloat16)
    now = before.clone()
    now[[3, 500, 999]] += 1
    now[10] = -0.0 if before[10] == 0 else -before[10]  # a sign flip: a change of the bits
    count, data = encode_changes(now.view(torch.uint8), before.view(torch.uint8), 2)
    assert count == 4 and len(data) == 4 * (4 + 2)
    place = before.clone().view(torch.uint8)
    apply_changes(place, count, data, 2)
    assert torch.equal(place.view(torch.bfloat16).view(torch.int16), now.view(torch.int16))
    unaligned = torch.empty(2001, dtype=torch.uint8)[1:]  # a tensor at an odd place of its file
    unaligned.copy_(before.view(torch.uint8))
    apply_changes(unaligned, count, data, 2)
    assert torch.equal(unaligned, now.view(torch.uint8))
    everything = before + 1
    assert encode_changes(everything.view(torch.uint8), before.view(torch.uint8), 2)[0] == WHOLE
    big = torch.randn(50_000)  # big enough to be sampled first
    few, most = big.clone(), big + 1
    few[::1000] += 1
    assert encode_changes(tensor_bytes(few), tensor_bytes(big), 4)[0] == 50  # the sample did not decide
    assert encode_changes(tensor_bytes(most), tensor_bytes(big), 4)[0] == WHOLE
    half = big.clone()
    half[:20_000] += 1  # below whole's 25,000 (4 + 4 bytes a change), above the sample's 2x margin: counted
    assert encode_changes(tensor_bytes(half), tensor_bytes(big), 4)[0] == 20_000
    index = torch.tensor([1000], dtype=torch.int32).view(torch.uint8)
    past_the_end = torch.cat([index, torch.zeros(2, dtype=torch.uint8)])  # one change: its index, its value
    with pytest.raises(ValueError, match="names element 1000..1000 of a tensor of 1000 elements"):
        apply_changes(before.clone().view(torch.uint8), 1, past_the_end, 2)


def test_a_sparse_sender_refuses_a_host_copy_the_host_cannot_hold(sparse_sender, tmp_path):
    model = TinyLM()
    served = (16 * 8 + 8 * 8 + 8 + 16 * 8) * 4  # the embedding, the projection and its bias, the tied head
    sparse_sender.check_host_memory(model, available=2 * served)
    with pytest.raises(TransferError, match=r"keeps a host copy of the served weights on trainer rank 0 \(0.0 GiB\), "
                                            r"but this host has 0.0 GiB available: use "
                                            r"transfer.sparse = false"):
        sparse_sender.check_host_memory(model, available=served)
    whole = collective_sender(CollectiveTransfer(backend="gloo", secret=SECRET), tmp_path / "whole",
                              single_rank_world(), torch.float32, first_step=0)
    try:
        whole.check_host_memory(model, available=1)  # a whole step keeps no copy
    finally:
        whole.close()


@pytest.mark.gpu
def test_on_one_gpu_a_sparse_nccl_sender_compares_on_the_gpu_and_hashes_through_pinned_host_memory(tmp_path,
                                                                                                   monkeypatch):
    """What one GPU can show of sparse_nccl's sender (the broadcast needs a second GPU): each step's changes are
    found on the GPU, equal to the host's encoding of the same bytes, and its bytes are kept in a pinned host copy;
    a GPU tensor hashes as its host bytes do, also when it passes the host in several chunks."""
    import rl.weights.digest
    from rl.weights.sparse import WHOLE, encode_changes
    from rl.weights.digest import TensorDigest, tensor_bytes

    monkeypatch.setattr(rl.weights.digest, "HOST_CHUNK_BYTES", 1000)  # every tensor below passes in several chunks
    world = SimpleNamespace(is_main=True, rank=0, world_size=1, on_gpu=True, device=torch.device("cuda", 0),
                            all_reduce=lambda values, op="sum": values)
    wire = CollectiveTransfer(backend="nccl", sparse=True, secret=SECRET)
    sender = collective_sender(wire, tmp_path, world, torch.bfloat16,
                              first_step=0)
    try:
        weights = {"a": torch.randn(3001, device="cuda").bfloat16(), "b": torch.randn(64, 65, device="cuda").bfloat16()}
        sender._keep_host_copy(list(weights), [2 * w.numel() for w in weights.values()])
        assert all(kept.is_pinned() for kept in sender.sent.values())
        before = {}
        for step in range(3):
            for name, weight in weights.items():
                data, host_before = tensor_bytes(weight), before.get(name)
                count, encoded = sender._changes(name, data, against_base=step > 0)
                assert encoded.device.type == "cuda" and torch.equal(sender.sent[name], data.cpu())
                if step == 0:
                    assert count == WHOLE
                else:
                    expected_count, expected = encode_changes(data.cpu(), host_before, 2)
                    assert count == expected_count == (7 if name == "a" else 5) and torch.equal(encoded.cpu(), expected)
                before[name] = data.cpu()
                on_gpu, on_host = TensorDigest(), TensorDigest()
                on_gpu.update(name, weight)
                on_host.update(name, weight.cpu())
                assert on_gpu.hexdigest() == on_host.hexdigest()
            weights["a"].view(-1)[::500] += 1  # 7 elements
            weights["b"].view(-1)[::900] += 1  # 5 elements
    finally:
        sender.close()
    assert sender.pinned is None and sender.sent == {}


def test_a_collective_sender_writes_a_steps_files_at_checkpoint_steps_only_and_never_step_0s(tmp_path):
    """Over the wire files are written only where a resume needs them: the steps a checkpoint is taken after, not the
    step-0 adapter offered at start-up."""
    from rl.config import CkptConfig

    written = []
    publisher = SimpleNamespace(dtype=torch.float32, adapter_config=None,
                                publish=lambda step, model: written.append(step))
    wire = CollectiveTransfer(backend="gloo", secret=SECRET)
    config = SimpleNamespace(transfer=wire, output_dir=tmp_path, max_steps=5,
                             ckpt=CkptConfig(interval=2))
    sender = GlooSender.create(config, publisher, single_rank_world(), first_step=0)
    sender.send = lambda step, model: {"weights_sent": True}
    try:
        for step in range(6):
            assert sender.publish(step, None) == {"weights_sent": True}
    finally:
        sender.close()
    assert written == [2, 4, 5]
