"""`weights_checksum`: the one checksum of a step's weights, however they travel (files or the wire), and the tag
that proves a step came from this run's trainer (`seal`)."""

from __future__ import annotations

import hashlib
import hmac

import torch
import xxhash

DIGEST_BYTES = 16
HOST_CHUNK_BYTES = 64 * 2**20  # a GPU tensor's bytes come to the host to be hashed in chunks of this size


class TensorDigest:
    """`weights_checksum`: per tensor, xxh3-128 of its name, dtype, shape and bytes; then xxh3-128 of those, by name.
    Independent of the order the tensors pass in, so the same weights have the same checksum whether they were read
    from files (however sharded: the files' tally) or received over the wire (the trainer's and the server's)."""

    def __init__(self):
        self._tensors: dict[str, bytes] = {}
        self._pinned: list[torch.Tensor] = []  # the two host buffers a GPU tensor's bytes pass through (`_hash_gpu`)

    def update(self, name: str, tensor: torch.Tensor) -> None:
        self.update_bytes(name, tensor.dtype, tuple(tensor.shape), tensor_bytes(tensor.detach()))

    def update_bytes(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], data: torch.Tensor) -> None:
        """A tensor given as its dtype, shape and raw bytes (a flat uint8 tensor, on the host or a GPU)."""
        one = xxhash.xxh3_128(f"{name}\0{dtype}\0{tuple(shape)}\0".encode())
        if data.is_cuda and len(data):
            self._hash_gpu(one, data)
        else:
            one.update(data.numpy())
        self._tensors[name] = one.digest()

    def _hash_gpu(self, one, data: torch.Tensor) -> None:
        """Hash a GPU tensor's bytes on the host, in chunks copied through two pinned buffers: the next chunk's copy
        goes on while this one is hashed. (A pageable copy of the whole tensor moved ~3 GB/s on an H200's host.)"""
        if not self._pinned:
            self._pinned = [torch.empty(HOST_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        starts = range(0, len(data), HOST_CHUNK_BYTES)
        copied = [torch.cuda.Event(), torch.cuda.Event()]
        with torch.cuda.device(data.device):
            def copy(index: int) -> None:
                part = data[starts[index]:starts[index] + HOST_CHUNK_BYTES]
                self._pinned[index % 2][:len(part)].copy_(part, non_blocking=True)
                copied[index % 2].record()

            copy(0)
            for index, start in enumerate(starts):
                if index + 1 < len(starts):  # into the other buffer, hashed already
                    copy(index + 1)
                copied[index % 2].synchronize()
                one.update(self._pinned[index % 2][:min(HOST_CHUNK_BYTES, len(data) - start)].numpy())

    def digest(self) -> bytes:
        whole = xxhash.xxh3_128()
        for name in sorted(self._tensors):
            whole.update(name.encode() + b"\0" + self._tensors[name])
        return whole.digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (what travels)."""
    return tensor.contiguous().view(-1).view(torch.uint8)



# What proves a step came from this run's trainer: a keyed BLAKE2b (a MAC) with a key derived from the run's secret
# (`transfer.secret`, which rl makes per run and writes only to the 0600 configs of the trainer and the servers). The
# trainer seals the step's header, then the step's checksum together with that header's seal; a server checks the
# first before it allocates anything for the step and the second before it loads a byte of it. A network peer that
# reaches the store or a group's sockets holds no key: what it sends is refused.
SEAL_BYTES = 32


def transfer_key(secret: str) -> bytes:
    """The key the seals are made with, derived from the run's secret (the secret itself never travels)."""
    return hashlib.blake2b(secret.encode(), digest_size=SEAL_BYTES, person=b"rl.weights.key").digest()


def seal(key: bytes, what: str, data: bytes) -> bytes:
    """The MAC of `data`, bound to what it is (`header`: which names its step; `checksum`: bound to its header's
    seal), so no seal of one step or part passes for another's."""
    mac = hashlib.blake2b(key=key, digest_size=SEAL_BYTES, person=b"rl.weights.seal")
    mac.update(f"{what}\0".encode())
    mac.update(data)
    return mac.digest()


def seal_matches(key: bytes, what: str, data: bytes, claimed: bytes) -> bool:
    return hmac.compare_digest(seal(key, what, data), claimed)
