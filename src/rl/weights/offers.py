"""Offers and takes: how the trainer and the orchestrator agree, through files in the run directory
(`RunPaths.transfer`), which step goes over the wire to how many servers, and where the trainer's store listens."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rl.atomic import atomic_write_text
from rl.manifest import CorruptFileError, read_regular
from rl.protocol import RunPaths
from rl.weights import TransferError

@dataclass(frozen=True)
class Offer:
    """What the trainer offers for a step: where its store listens, and the step's size."""

    step: int
    host: str
    port: int
    tensor_bytes: int


@dataclass(frozen=True)
class GroupSpec:
    """A server's place in a step's group, as the orchestrator posts it to /update_weights."""

    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float


def write_offer(output_dir: Path, offer: Offer) -> None:
    atomic_write_text(RunPaths(Path(output_dir)).offer(offer.step), json.dumps(asdict(offer)))


MAX_OFFER_BYTES = 4096  # an offer is ~100 bytes


HOST_PATTERN = r"[A-Za-z0-9._:\[\]-]{1,255}"  # a host name, IPv4 or IPv6 address, as a server takes it to connect to


def read_offer(output_dir: Path, step: int, host: str | None = None) -> Offer | None:
    """The trainer's offer of `step`, None if there is none. It is read only as the trainer writes it: a regular file
    (not a link, a FIFO or a device: nothing can stall the reader), of a few bytes, whose fields have their types and
    ranges, name the step of the file's name and (if given) the trainer's `host`; anything else is a TransferError
    naming the file and the problem."""
    path = RunPaths(Path(output_dir)).offer(step)
    if not os.path.lexists(path):  # looked for first: one renamed into place mid-read is not "missing"
        return None
    try:
        raw = read_regular(path.parent, path.name, MAX_OFFER_BYTES)
    except CorruptFileError as e:
        if not os.path.lexists(path):
            return None  # taken away (a resumed trainer clears the old ones)
        raise TransferError(f"{path} is not an offer the trainer wrote: {e}") from None
    try:
        fields = json.loads(raw)
    except ValueError as e:
        raise TransferError(f"{path} is not an offer the trainer wrote: {e}") from None
    problem = offer_problem(fields, step)
    if problem is None and host is not None and fields["host"] != host:
        problem = f"it names host {fields['host']!r}, but the trainer's store is at transfer.host {host!r}"
    if problem:
        raise TransferError(f"{path} is not an offer the trainer wrote: {problem}")
    return Offer(**fields)


def offer_problem(fields, step: int) -> str | None:
    """What is wrong with an offer's fields, read from the file of `step`; None if nothing."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(fields, dict) or set(fields) != {f.name for f in dataclasses.fields(Offer)}:
        return f"its fields are not {[f.name for f in dataclasses.fields(Offer)]}"
    if not whole(fields["step"]) or fields["step"] != step:
        return f"it offers step {fields['step']!r} in the file of step {step}"
    if not whole(fields["port"]) or not 1 <= fields["port"] <= 65535:
        return f"port {fields['port']!r} is not a port from 1 to 65535"
    if not whole(fields["tensor_bytes"]) or fields["tensor_bytes"] < 0:
        return f"tensor_bytes {fields['tensor_bytes']!r} is not a size"
    if not isinstance(fields["host"], str) or not re.fullmatch(HOST_PATTERN, fields["host"]):
        return f"host {fields['host']!r} is not a host name or address"
    return None


# ASCII digits: str.isdigit takes '²', which int refuses
TRANSFER_FILE = re.compile(r"(offer|take|sent)_([0-9]+)\.json")


def offered_steps(output_dir: Path) -> list[int]:
    matches = (TRANSFER_FILE.fullmatch(path.name) for path in RunPaths(Path(output_dir)).transfer.glob("offer_*.json"))
    return sorted(int(match[2]) for match in matches if match)


def write_take(output_dir: Path, step: int, receivers: int) -> None:
    atomic_write_text(RunPaths(Path(output_dir)).take(step), json.dumps({"step": step, "receivers": receivers}))


def wait_for_take(output_dir: Path, step: int, timeout_s: float) -> int:
    """The number of receivers the orchestrator asked to take step `step`; TransferError after `timeout_s`."""
    path = RunPaths(Path(output_dir)).take(step)
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TransferError(f"waited {timeout_s:.0f} s for the orchestrator to take the weights of step {step} "
                                f"({path} never appeared): is the orchestrator running?")
        time.sleep(0.005)  # a stat per 5 ms: the take is on the critical path of every step
    return int(json.loads(path.read_text())["receivers"])


def clear_transfers(output_dir: Path, from_step: int = 0) -> None:
    """Remove the offers, takes and sent checksums of steps >= `from_step` (a resumed run offers them again, on
    another store)."""
    for path in RunPaths(Path(output_dir)).transfer.glob("*.json"):
        match = TRANSFER_FILE.fullmatch(path.name)
        if match and int(match[2]) >= from_step:
            path.unlink(missing_ok=True)



def write_sent(output_dir: Path, step: int, checksum: str) -> None:
    """Trainer rank 0, once a step went out whole and sealed: the checksum every server must report it serves."""
    atomic_write_text(RunPaths(Path(output_dir)).sent(step), json.dumps({"step": step, "weights_checksum": checksum}))


def read_sent(output_dir: Path, step: int, timeout_s: float) -> str | None:
    """The checksum the trainer sent as step `step`'s, waited for up to `timeout_s` (the trainer writes it as soon as
    its last broadcast is done); None if it did not (its transfer failed) or the file is not the trainer's."""
    paths, deadline = RunPaths(Path(output_dir)), time.monotonic() + timeout_s
    while not os.path.lexists(paths.sent(step)):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    try:
        fields = json.loads(read_regular(paths.transfer, paths.sent(step).name, MAX_OFFER_BYTES))
    except (CorruptFileError, ValueError):
        return None
    checksum = fields.get("weights_checksum") if isinstance(fields, dict) and fields.get("step") == step else None
    return checksum if isinstance(checksum, str) else None
