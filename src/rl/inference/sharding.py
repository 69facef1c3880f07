"""Which part of each checkpoint tensor a tensor-parallel worker serves, read off vLLM's own layers.

With tensor parallel size T, worker t of a server holds (vLLM's Megatron layout):
- column-parallel projections (q/k/v, gate/up, ...): rows [t L, (t + 1) L) of each checkpoint tensor fused into the
  layer, L = its rows / T; a key/value projection with fewer heads than T is replicated, R = T / heads workers
  holding the same rows (worker t holds part t // R);
- row-parallel projections (o_proj, down_proj): columns [t L, (t + 1) L) of the input, L = in / T;
- the vocab-parallel embedding and LM head: rows [start, end) of the vocabulary (vLLM pads the vocabulary to a
  multiple of 64 before splitting it, so the last worker's part is shorter);
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
class Part:
    """One checkpoint tensor's rows in a (possibly fused) column-parallel layer: `local` rows served here out of
    `full`, from row `shard.start` (shard None: the whole tensor)."""

    local: int
    full: int
    shard: Shard | None


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
