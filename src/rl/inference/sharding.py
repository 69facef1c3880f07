"""Which part of each checkpoint tensor a tensor-parallel worker serves, read off vLLM's own layers.

With tensor parallel size T, worker t of a server holds (vLLM's Megatron layout):
- column-parallel projections (q/k/v, gate/up, ...): rows [t L, (t + 1) L) of each checkpoint tensor fused into the
  layer, L = its rows / T; a key/value projection with fewer heads than T is replicated, R = T / heads workers
  holding the same rows (worker t holds part t // R);
- row-parallel projections (o_proj, down_proj): columns [t L, (t + 1) L) of the input, L = in / T;
- the vocab-parallel embedding and LM head: rows [start, end) of the vocabulary (vLLM pads the vocabulary to a
  multiple of 64 before splitting it, so the last worker's part is shorter);
- Gated DeltaNet (Qwen3.5's linear attention): `in_proj_qkv` and the convolution's rows are three parts, q, k and
  v, each split on its own, so a worker serves three row ranges of the tensor (`Pieces`); `A_log` and `dt_bias` are
  split by value head;
- everything else (norms, a row-parallel bias): the whole tensor.

A `Shard` names that part in checkpoint coordinates, so the files' side of a verification can cut the same part
out of the whole tensor it reads (`Shard.of`). With T = 1 every part is the whole tensor (shard None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """Elements [start, start + length) along `dim` of a checkpoint tensor."""

    dim: int
    start: int
    length: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True)
class Pieces:
    """Several ranges along one dimension of a checkpoint tensor, served here one after another."""

    shards: tuple[Shard, ...]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([shard.of(tensor) for shard in self.shards], self.shards[0].dim)


def pieces(sizes: list[int], rank: int, size: int) -> Pieces:
    """Worker `rank`'s rows of a tensor made of consecutive parts of `sizes` rows, each split over `size` workers."""
    shards, start = [], 0
    for full in sizes:
        local = full // size
        shards.append(Shard(0, start + rank * local, local))
        start += full
    return Pieces(tuple(shards))


def linear_attention_shards(module) -> dict[str, Shard | Pieces | None]:
    """The shards of a Gated DeltaNet layer's own tensors on this worker, by their names in the layer: the
    convolution's rows as vLLM's mamba loader splits them (q, k and v on their own), `A_log` and `dt_bias` by value
    head; None for every one without tensor parallelism."""
    rank, size = tp_rank_size(module)
    if size == 1:
        return dict.fromkeys(("conv1d.weight", "A_log", "dt_bias"))
    heads = module.num_v_heads // size
    return {"conv1d.weight": pieces([module.key_dim, module.key_dim, module.value_dim], rank, size),
            "A_log": Shard(0, rank * heads, heads), "dt_bias": Shard(0, rank * heads, heads)}


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's rows in a (possibly fused) column-parallel layer: `local` rows served here out of
    `full`, from row `shard.start` (shard None: the whole tensor)."""

    local: int
    full: int
    shard: Shard | Pieces | None


def tp_rank_size(module) -> tuple[int, int]:
    return getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)


def output_parts(module) -> list[Part]:
    """The checkpoint tensors fused into a linear layer's outputs, in order, each with the rows served here."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear

    rank, size = tp_rank_size(module)
    locals_ = list(getattr(module, "output_partition_sizes", [module.output_size]))
    column = isinstance(module, ColumnParallelLinear) and size > 1
    parts = []
    for index, local in enumerate(locals_):
        if not column:
            parts.append(Part(local, local, None))
            continue
        replicas = module.num_kv_head_replicas if isinstance(module, QKVParallelLinear) and index > 0 else 1
        full, holder = local * size // replicas, rank // replicas
        parts.append(Part(local, full, Shard(0, holder * local, local)))
    return parts


def input_shard(module) -> tuple[int, Shard | None]:
    """(inputs served here, the shard of the checkpoint's input columns) of a linear layer: row-parallel layers
    split their input, every other layer takes it whole."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    local = getattr(module, "input_size_per_partition", module.input_size)
    rank, size = tp_rank_size(module)
    if isinstance(module, RowParallelLinear) and size > 1:
        return local, Shard(1, rank * local, local)
    return local, None


def vocab_rows(module) -> tuple[int, Shard | None]:
    """(real vocabulary rows served here, their shard) of a vocab-parallel embedding or LM head: its first
    `num_org_elements` rows are vocabulary rows [org_vocab_start_index, org_vocab_end_index), the rest padding."""
    indices = module.shard_indices
    rows = indices.org_vocab_end_index - indices.org_vocab_start_index
    if getattr(module, "tp_size", 1) == 1:
        return rows, None
    return rows, Shard(0, indices.org_vocab_start_index, rows)
