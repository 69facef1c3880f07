"""Trust round 5: every wait of a step over the wire ends by the step's deadline on both ends, with a message that
names what went wrong. A store client can write any key (torch's TCPStore has no authentication), among them the
address a member of a step's group publishes for its peers; gloo's own forming then waits on the member left
without a peer for about five times the timeout it is given. Real gloo groups in threads of this process, as in
test_transfer.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from rl.weights import TransferError
from rl.weights.group import Deadline, connect_store, open_group, start_store


def moved(published: bytes, port: int) -> bytes:
    """A member's published address (gloo's: a length-prefixed host name, then a sockaddr) moved to `port`, as an
    old address of a member gone since would be. Of two members, gloo has the one with the greater address connect
    and the other wait to be connected: port 1 (nothing listens there) sorts before any address gloo listens on,
    65535 after."""
    host = int.from_bytes(published[:8], "little")
    family = 8 + host + 8  # after the host name and the address's length
    assert published[family:family + 2] == b"\x02\x00", published.hex()  # AF_INET (the store is on 127.0.0.1)
    return published[:family + 2] + port.to_bytes(2, "big") + published[family + 4:]


def form(store, step, rank, deadline):
    start = time.monotonic()
    try:
        return open_group(store, step, rank, 2, deadline, "gloo", "test"), time.monotonic() - start
    except TransferError as e:
        return e, time.monotonic() - start


@pytest.mark.parametrize("rank", [0, 1])  # rank 0: the trainer; rank 1: a server
def test_a_stale_peer_address_in_the_store_ends_group_forming_by_the_deadline_naming_the_cause(rank):
    """A store client writes an old address of the other member where this one reads it. Where that address sorts
    after this member's, this member waits to be connected, which never happens (gloo alone waits ~5x the timeout
    it is given): it gives up at the step's deadline, saying that not every member connected. Where it sorts before,
    this member connects to it, a closed port, and fails at once: the refusal is named, not a deadline."""
    timeout_s = 1.0
    store = start_store("127.0.0.1", 0, 10)
    member = store if rank == 0 else connect_store("127.0.0.1", store.port, Deadline(10, 1))
    attacker = connect_store("127.0.0.1", store.port, Deadline(10, 1))
    template = []  # an address gloo published in this store, on this host, for a group formed before

    def publish_old_address(step: int, port: int) -> None:
        while not template:  # the member's own address, once it published it
            with contextlib.suppress(Exception):
                template.append(attacker.get(f"step_{step}/group/0/{rank}"))
        attacker.set(f"step_{step}/group/0/{1 - rank}", moved(template[0], port))

    writer = threading.Thread(target=publish_old_address, args=(1, 65535))
    writer.start()
    waited, took = form(member, 1, rank, Deadline(timeout_s, 1))
    writer.join(10)
    assert took < timeout_s + 0.5, (took, waited)
    assert isinstance(waited, TransferError), waited
    assert f"did not form within {timeout_s:g} s (rank {rank} of 2)" in str(waited)
    assert "not every member connected" in str(waited)

    publish_old_address(2, 1)  # before the member forms: it reads it at once
    refused, took = form(member, 2, rank, Deadline(timeout_s, 2))
    assert isinstance(refused, TransferError), refused
    assert "did not form within" not in str(refused) and "Connection refused" in str(refused), refused
    assert f"failed to form after {took:.1f}"[:-1] in str(refused) and took < timeout_s / 2
    for thread in threading.enumerate():  # what gloo still does for the member given up on, before the next test
        if thread.name.startswith("forming the transfer group of step 1"):
            thread.join(6 * timeout_s + 5)


def test_a_closed_store_port_is_named_as_refused_at_once():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    start = time.monotonic()
    with pytest.raises(TransferError, match=f"nothing listens at 127.0.0.1:{port} .connection refused."):
        connect_store("127.0.0.1", port, Deadline(3, 1))
    assert time.monotonic() - start < 1.0
