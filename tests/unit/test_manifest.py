"""The STABLE marker as the exact manifest of a directory: what a reader refuses, and that it never blocks,
follows a link out or crashes on what it reads."""

import json
import os
import random
import threading

import pytest
import torch
from safetensors.torch import save

from rl.listed_files import read_listed, verify_stable
from rl.manifest import CorruptFileError, Entry, mark_stable, read_manifest
from rl.protocol import RunPaths, read_batch, write_batch
from rl.samples import Sample, encode_samples


def finishes(fn, timeout_s=10.0):
    """Run `fn` in a thread; fail (instead of hanging the suite) if it blocks. Returns its exception or None."""
    outcome = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} blocked for {timeout_s} s"
    return outcome.get("error")


@pytest.fixture
def published(tmp_path):
    directory = tmp_path / "weights" / "step_1"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (directory / "config.json").write_text("{}")
    mark_stable(directory, step=1)
    return directory


def test_an_unlisted_file_makes_the_directory_corrupt(published):
    (published / "zz.safetensors").write_bytes(b"extra weights")
    with pytest.raises(CorruptFileError, match="zz.safetensors is not listed"):
        read_manifest(published)


def test_an_unlisted_fifo_is_refused_without_opening_it(published):
    os.mkfifo(published / "zz.safetensors")
    error = finishes(lambda: verify_stable(published))
    assert isinstance(error, CorruptFileError) and "not a regular file" in str(error)


def test_a_listed_fifo_under_a_hand_made_marker_does_not_block(tmp_path):
    paths = RunPaths(tmp_path)
    paths.rollouts(0).mkdir(parents=True)
    os.mkfifo(paths.rollout_file(0, 0))
    (paths.rollouts(0) / "STABLE").write_text("{}")  # hand-made: vouches for completeness only
    error = finishes(lambda: read_batch(paths, 0, 0))
    assert isinstance(error, ValueError) and "not a regular file" in str(error)


def test_a_fifo_swapped_in_after_the_listing_is_not_read(published):
    manifest = read_manifest(published)
    (published / "model.safetensors").unlink()
    os.mkfifo(published / "model.safetensors")
    error = finishes(lambda: read_listed(published, "model.safetensors", manifest["model.safetensors"]))
    assert isinstance(error, CorruptFileError) and "not a regular file" in str(error)


def test_no_symlink_is_followed_at_any_component(tmp_path, published):
    """step_k/sub -> ../hop, hop/etc -> /etc, the marker listing sub/etc/hostname: two hops out of the directory."""
    hop = published.parent / "hop"
    hop.mkdir()
    (hop / "etc").symlink_to("/etc")
    (published / "sub").symlink_to("../hop")
    hostname = os.stat("/etc/hostname").st_size if os.path.exists("/etc/hostname") else 0
    marker = json.loads((published / "STABLE").read_text())
    marker["files"]["sub/etc/hostname"] = {"bytes": hostname, "crc32": 0}
    (published / "STABLE").write_text(json.dumps(marker))
    with pytest.raises(CorruptFileError, match="sub is a symlink"):
        verify_stable(published)
    # the opener refuses it by itself too, whatever the listing said
    with pytest.raises(CorruptFileError, match="'sub' is a symlink"):
        read_listed(published, "sub/etc/hostname", Entry(hostname, 0))


def test_a_file_replaced_by_a_symlink_is_refused(published):
    target = published.parent / "elsewhere.safetensors"
    target.write_bytes((published / "model.safetensors").read_bytes())
    (published / "model.safetensors").unlink()
    (published / "model.safetensors").symlink_to(target)
    with pytest.raises(CorruptFileError, match="model.safetensors is a symlink"):
        verify_stable(published)


def test_read_listed_reads_once_and_checks_the_crc(published):
    manifest = read_manifest(published)
    data = read_listed(published, "model.safetensors", manifest["model.safetensors"], chunk=100)
    assert bytes(data) == (published / "model.safetensors").read_bytes()
    with open(published / "model.safetensors", "r+b") as f:
        f.write(b"\xff")  # same size, other bytes
    with pytest.raises(CorruptFileError, match="fails its CRC-32 check"):
        read_listed(published, "model.safetensors", manifest["model.safetensors"])


def test_copy_listed_copies_into_the_memfd_and_checks_the_bytes_where_they_landed(published, monkeypatch):
    """The server's read of a weight file: copied by the kernel into a memfd, its size and CRC-32 checked there."""
    from rl.listed_files import copy_listed

    manifest = read_manifest(published)
    entry, expected = manifest["model.safetensors"], (published / "model.safetensors").read_bytes()
    fd = os.memfd_create("copy")
    try:
        data = copy_listed(published, "model.safetensors", entry, fd)
        assert bytes(data) == expected == os.pread(fd, 10**6, 0) and os.fstat(fd).st_size == len(expected)
        data.close()
        with pytest.raises(CorruptFileError, match=f"has {len(expected)} bytes, 3 were written"):
            copy_listed(published, "model.safetensors", Entry(3, entry.crc32), fd)
        monkeypatch.setattr(os, "sendfile", lambda out, source, offset, count: min(count, 7) if offset < 14 else 0)
        with pytest.raises(CorruptFileError, match=f"ended after 14 of {len(expected)} bytes: truncated while read"):
            copy_listed(published, "model.safetensors", entry, fd)
        monkeypatch.undo()
        with open(published / "model.safetensors", "r+b") as f:
            f.write(b"\xff")  # same size, other bytes
        with pytest.raises(CorruptFileError, match="fails its CRC-32 check"):
            copy_listed(published, "model.safetensors", entry, fd)
    finally:
        os.close(fd)


def batch_file(lengths: list[int], tokens: int) -> dict[str, torch.Tensor]:
    tensors = encode_samples([Sample([1] * tokens, [1] * tokens, [0.0] * tokens, 0.5, 1.0, 0)])
    tensors["lengths"] = torch.tensor(lengths, dtype=torch.int64)
    for name in ("advantages", "rewards"):
        tensors[name] = torch.zeros(len(lengths))
    tensors["policy_versions"] = torch.zeros(len(lengths), dtype=torch.int64)
    return tensors


def test_batch_lengths_that_overflow_int64_are_refused(tmp_path):
    paths = RunPaths(tmp_path)
    write_batch(paths, 0, [[Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 0.5, 1.0, 0)]])
    path = paths.rollout_file(0, 0)
    path.write_bytes(save(batch_file([2**63 - 1, 2**63 - 1, 5], tokens=3)))
    mark_stable(paths.rollouts(0))  # as a writer would: only the format check can refuse it
    with pytest.raises(ValueError, match="input_ids has 3 entries for 18446744073709551619 tokens"):
        read_batch(paths, 0, 0)


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 2**64, 2**63 - 1, rng.randrange(-(10**30), 10**30), 1.5, float("inf")])
    if kind == 2:
        return rng.choice(["", "..", "/", "a/../b", "model.safetensors", "x" * 300, "\ud800", "a\0b", "STABLE"])
    if kind in (3, 4):
        return rng.choice(["files", "bytes", "crc32", "step"])
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["files", "bytes", "crc32", "model.safetensors", "rank_0.safetensors", "sub/x", "../x", "step"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_fuzz_markers_and_batches_give_only_corrupt_file_errors(tmp_path):
    """Random bytes and random JSON as the marker, random bytes as a batch file: the readers answer with
    CorruptFileError (batches: ValueError) or accept; they never raise anything else."""
    rng = random.Random(1234)
    paths = RunPaths(tmp_path)
    write_batch(paths, 0, [[Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 0.5, 1.0, 0)]])
    directory, good = paths.rollouts(0), paths.rollout_file(0, 0).read_bytes()
    for i in range(300):
        case = i % 3
        if case == 0:
            marker = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        else:
            marker = json.dumps(random_json(rng), ensure_ascii=True).encode()
        (directory / "STABLE").write_bytes(marker)
        try:
            verify_stable(directory)
        except CorruptFileError:
            pass
        if case == 2:  # a batch file of flipped or truncated bytes under a valid marker
            data = bytearray(good)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            paths.rollout_file(0, 0).write_bytes(bytes(data[: rng.randrange(len(data) + 1)]))
            mark_stable(directory)
            try:
                read_batch(paths, 0, 0)
            except ValueError:
                pass
            paths.rollout_file(0, 0).write_bytes(good)
