"""Weights over the wire (rl/transfer.py): the trainer's sender and the servers' receivers over a real gloo group in
one process (threads), with the orchestrator's part (the take) played by the test."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl.config import TransferConfig
from rl.inference.staging import WIRE_FILE, receive_weights
from rl.manifest import CorruptFileError
from rl.safetensors_io import tensors_of
from rl.trainer.transfer import CollectiveSender
from rl.transfer import GroupSpec, TransferError, offered_steps, read_offer, write_take
from rl.trainer.weights import TIED_HEAD


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


def run_step(tmp_path, sender, model, step, receivers, corrupt=None, timeout_s=10.0):
    """Offer `step`, take it for `receivers` servers, receive it in threads; returns the sender's stats and each
    receiver's (staged, checksum) or exception."""
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
            results[rank] = receive_weights(spec, step, corrupt if rank == 1 else None)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[rank] = e

    threads = [threading.Thread(target=receive, args=(rank,)) for rank in range(1, receivers + 1)]
    for t in threads:
        t.start()
    for t in threads + [thread]:
        t.join(60)
        assert not t.is_alive(), "a transfer thread hung"
    return stats, results


@pytest.fixture
def sender(tmp_path):
    config = TransferConfig(transport="gloo", timeout_s=5, offer_timeout_s=10)
    sender = CollectiveSender(config, tmp_path, single_rank_world(), torch.float32, first_step=0)
    yield sender
    sender.close()


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
    with pytest.raises(TransferError, match="did not form within"):
        receive_weights(GroupSpec(offer.host, offer.port, 1, 3, 2.0), 2)
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
    from rl.transfer import connect_store, open_group, receive_header

    group = open_group(connect_store(spec.host, spec.port, spec.timeout_s), group_step, spec.rank, spec.world_size,
                       spec.timeout_s)
    receive_header(group, asked_step)


def test_the_trainer_gives_up_on_an_offer_nobody_takes(tmp_path):
    config = TransferConfig(transport="gloo", timeout_s=5, offer_timeout_s=0.5)
    sender = CollectiveSender(config, tmp_path, single_rank_world(), torch.float32, first_step=0)
    with pytest.raises(TransferError, match="waited 0 s for the orchestrator to take the weights of step 1"):
        sender.send(1, TinyLM())


def test_an_adapter_arrives_with_its_config_and_is_written_as_a_checked_private_copy(tmp_path):
    from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from rl.inference.staging import PrivateCopies
    from rl.manifest import read_listed

    config = b'{"peft_type": "LORA", "r": 2}'
    sender = CollectiveSender(TransferConfig(transport="gloo", timeout_s=5, offer_timeout_s=10), tmp_path,
                              single_rank_world(), torch.float32, first_step=0, adapter_config=config)
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
        TransferConfig(transport="nccl").check_device("cpu", "inference")
    TransferConfig(transport="nccl").check_device("cuda", "trainer")
    with pytest.raises(TransferError, match="needs the trainer on CUDA GPUs"):
        CollectiveSender(TransferConfig(transport="nccl"), Path("unused"),
                         SimpleNamespace(is_main=True, on_gpu=False, device=torch.device("cpu")), torch.float32, 0)


NCCL_RECEIVER = """
import sys, torch
from rl.inference.staging import receive_weights
from rl.transfer import GroupSpec
torch.cuda.set_device(1)
host, port, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
received = receive_weights(GroupSpec(host, port, 1, 2, 60.0), step, backend="nccl")
print("checksum", received.checksum, received.staged.bytes)
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL will not join two ranks on one GPU")
def test_over_nccl_a_step_leaves_the_trainers_gpu_and_arrives_in_the_servers_with_the_trainers_checksum(tmp_path):
    """The GPU path of rl.transfer: the trainer's sender broadcasts from cuda:0 over NCCL, a receiver process on
    cuda:1 (as a server's first worker) gets it into its GPU and stages it; both hash the same bytes."""
    import subprocess
    import sys

    world = SimpleNamespace(is_main=True, rank=0, world_size=1, on_gpu=True, device=torch.device("cuda", 0),
                            all_reduce=lambda values, op="sum": values)
    torch.cuda.set_device(0)
    sender = CollectiveSender(TransferConfig(transport="nccl", timeout_s=60, offer_timeout_s=60), tmp_path, world,
                              torch.bfloat16, first_step=0)
    model = TinyLM().cuda()
    stats: dict = {}
    thread = threading.Thread(target=lambda: stats.update(sender.send(1, model)))
    thread.start()
    while 1 not in offered_steps(tmp_path):
        time.sleep(0.01)
    offer = read_offer(tmp_path, 1)
    write_take(tmp_path, 1, 1)
    receiver = subprocess.run([sys.executable, "-c", NCCL_RECEIVER, offer.host, str(offer.port), "1"],
                              capture_output=True, text=True, timeout=300)
    thread.join(120)
    assert receiver.returncode == 0, receiver.stderr[-3000:]
    assert stats["weights_sent"] is True
    checksum = receiver.stdout.split()[receiver.stdout.split().index("checksum") + 1]
    assert checksum == stats["weights_checksum"]
    sender.close()
