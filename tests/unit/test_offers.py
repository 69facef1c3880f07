"""The trainer's offers (`transfer/offer_<k>.json`) as the orchestrator reads them, and the transfer part of an
/update_weights body, when someone other than rl wrote them: read only as regular files, without blocking, their
fields checked; an offer the trainer cannot have made yet is not taken, and later real offers still are."""

import asyncio
import json
import logging
import os
import threading

import pytest
from pydantic import ValidationError

from rl.inference.gate import TransferRequest
from rl.protocol import RunPaths
from rl.weights import TransferError
from rl.weights.offers import Offer, clear_transfers, offered_steps, read_offer, write_offer, write_sent
from tests.unit.test_orchestrator_servers import FakePool, orchestrator

GOOD = {"step": 3, "host": "127.0.0.1", "port": 29500, "tensor_bytes": 1024}


def write(tmp_path, step: int, fields) -> None:
    RunPaths(tmp_path).offer(step).parent.mkdir(parents=True, exist_ok=True)
    RunPaths(tmp_path).offer(step).write_text(json.dumps(fields))


def test_an_offer_as_the_trainer_writes_it_is_read(tmp_path):
    write_offer(tmp_path, Offer(**GOOD))
    assert read_offer(tmp_path, 3, "127.0.0.1") == Offer(**GOOD)
    assert read_offer(tmp_path, 4) is None


def test_offers_renamed_into_place_while_a_reader_polls_for_them_are_never_called_corrupt(tmp_path):
    """A poll whose open finds no file, while the trainer's rename lands before it looks again, once read a
    just-written offer as "missing"; each offer here is polled for as it is written."""
    RunPaths(tmp_path).offer(0).parent.mkdir(parents=True)
    steps, errors = range(1, 301), []

    def writer():
        for step in steps:
            write_offer(tmp_path, Offer(**GOOD | {"step": step}))

    def reader():
        try:
            for step in steps:
                while read_offer(tmp_path, step) is None:
                    pass
        except TransferError as e:
            errors.append(e)

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not [t for t in threads if t.is_alive()], "a reader or the writer still runs after 60 s"
    assert not errors


@pytest.mark.parametrize("change, named", [
    ({"port": "abc"}, "port 'abc'"),
    ({"port": 0}, "port 0"),
    ({"port": True}, "port True"),
    ({"step": 4}, "offers step 4 in the file of step 3"),
    ({"step": "3"}, "offers step '3'"),
    ({"tensor_bytes": -1}, "tensor_bytes -1"),
    ({"host": "evil host; rm"}, "host 'evil host; rm'"),
    ({"host": 7}, "host 7"),
    ({"extra": 1}, "its fields are not"),
])
def test_an_offer_with_a_field_out_of_type_or_range_is_refused_naming_it(tmp_path, change, named):
    write(tmp_path, 3, GOOD | change)
    with pytest.raises(TransferError, match=named.replace("(", r"\(")):
        read_offer(tmp_path, 3)


def test_an_offer_naming_another_host_than_the_trainers_is_refused(tmp_path):
    write(tmp_path, 3, GOOD | {"host": "10.9.9.9"})
    assert read_offer(tmp_path, 3) == Offer(**GOOD | {"host": "10.9.9.9"})
    with pytest.raises(TransferError, match="names host '10.9.9.9', but the trainer's store is at transfer.host"):
        read_offer(tmp_path, 3, "127.0.0.1")


def test_an_offer_that_is_a_fifo_a_link_or_too_long_is_refused_without_blocking(tmp_path):
    RunPaths(tmp_path).transfer.mkdir()
    os.mkfifo(RunPaths(tmp_path).offer(1))  # nobody writes: a blocking read would wait forever
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(GOOD | {"step": 2}))
    RunPaths(tmp_path).offer(2).symlink_to(outside)
    write(tmp_path, 3, GOOD | {"host": "a" * 5000})
    refused = []

    def read_all():
        for step, named in ((1, "not a regular file"), (2, "symlink"), (3, "more than 4096 bytes")):
            with pytest.raises(TransferError, match=named):
                read_offer(tmp_path, step)
            refused.append(step)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and refused == [1, 2, 3], "a read blocked or was not refused"


def test_only_ascii_digits_name_a_step(tmp_path):
    RunPaths(tmp_path).transfer.mkdir()
    for name in ("offer_².json", "offer_1.5.json", "offer_x.json", "offer_.json", "offer_7.json", "take_².json",
                 "take_7.json", "offer_8.txt"):
        (RunPaths(tmp_path).transfer / name).write_text("{}")
    assert offered_steps(tmp_path) == [7]  # '²'.isdigit() is True, and int('²') fails
    clear_transfers(tmp_path, 0)
    assert sorted(p.name for p in RunPaths(tmp_path).transfer.iterdir()) == [
        "offer_.json", "offer_1.5.json", "offer_8.txt", "offer_x.json", "offer_².json", "take_².json"]


class WirePool(FakePool):
    async def receive_weights(self, step, host, port, timeout_s, servers):
        write_sent(self.output_dir, step, "c")  # the trainer's side of the transfer: it sent checksum c
        self.received.append(step)
        for i in servers:
            self.replies[i] = {"step": step, "instance": self.replies[i]["instance"]}
        return [{"step": step, "weights_checksum": "c"} for _ in servers]


def wire_orchestrator(tmp_path):
    pool = WirePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    pool.received, pool.output_dir = [], tmp_path
    o = orchestrator(tmp_path, pool, collective=True)
    asyncio.run(o.servers.check())
    return o, pool


def test_an_offer_beyond_what_the_trainer_can_have_offered_is_not_taken_and_later_ones_are(tmp_path, caplog):
    o, pool = wire_orchestrator(tmp_path)
    write_offer(tmp_path, Offer(10**12, "127.0.0.1", 1234, 10))
    write_offer(tmp_path, Offer(1, "127.0.0.1", 1234, 10))
    with caplog.at_level(logging.WARNING):
        asyncio.run(o.sync.take_offers(1, 1, "batch 1"))
        write_offer(tmp_path, Offer(2, "127.0.0.1", 1234, 10))
        asyncio.run(o.sync.take_offers(2, 2, "batch 2"))
    assert pool.received == [1, 2] and o.servers.served_steps == [2, 2]
    warned = [r.message for r in caplog.records if "not taken" in r.message]
    assert warned == [f"offer of policy {10**12} not taken: the trainer cannot have offered a policy after 1 yet"]


def test_an_offer_not_as_the_trainer_writes_them_is_skipped_with_a_warning_and_the_next_is_taken(tmp_path, caplog):
    o, pool = wire_orchestrator(tmp_path)
    RunPaths(tmp_path).transfer.mkdir()
    os.mkfifo(RunPaths(tmp_path).offer(1))
    write_offer(tmp_path, Offer(2, "127.0.0.1", 1234, 10))
    with caplog.at_level(logging.WARNING):
        asyncio.run(asyncio.wait_for(o.sync.take_offers(2, 2, "batch 2"), 10))
    assert pool.received == [2]
    assert any("offer of policy 1 not taken" in r.message and "not a regular file" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("timeout_s", [True, "5"])
def test_an_update_bodys_transfer_timeout_is_a_number_not_a_bool_or_text(timeout_s):
    fields = {"host": "127.0.0.1", "port": 1234, "rank": 1, "world_size": 2}
    assert TransferRequest(**fields, timeout_s=60).timeout_s == 60.0
    with pytest.raises(ValidationError, match="timeout_s"):
        TransferRequest(**fields, timeout_s=timeout_s)


def test_the_newest_offer_a_batch_can_get_waits_for_the_next_batch_while_the_servers_serve_what_it_needs(tmp_path):
    """At batch 3 (async_level 1: it needs policy 2; the trainer can have offered 3) with policy 2 served, offer 3
    waits: had its transfer failed everywhere, batch 3 could get no later offer, and the trainer needs batch 3 to
    make one. Batch 4 needs policy 3: it takes the offer."""
    o, pool = wire_orchestrator(tmp_path)
    for step in (1, 2):
        write_offer(tmp_path, Offer(step, "127.0.0.1", 1234, 10))
        asyncio.run(o.sync.take_offers(step, step, f"batch {step}"))
    write_offer(tmp_path, Offer(3, "127.0.0.1", 1234, 10))
    asyncio.run(o.sync.take_offers(2, 3, "batch 3"))
    assert pool.received == [1, 2] and o.servers.served_steps == [2, 2]
    asyncio.run(o.sync.take_offers(3, 4, "batch 4"))
    assert pool.received == [1, 2, 3] and o.servers.served_steps == [3, 3]
