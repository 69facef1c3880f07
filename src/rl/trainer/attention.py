"""Attention over packed rows, one sample at a time.

transformers' sdpa sees a packed row as one sequence under a block-diagonal causal mask: it computes every pair
of the row's tokens and then masks most of them (in a 512-token row of 30-token samples, the pairs within a
sample are ~1/17 of the row's). Given the row's sample lengths, this attends each sample on its own (causal
sdpa, no mask), so the pairs computed are the pairs kept, and rows can be long without attention growing with
their square.

Registered with transformers under `PACKED_SDPA`; the trainer loads its models with it for
`attn_implementation = "sdpa"` on CPU (`transformers_attention`; not with `compile`: the lengths would recompile
each block every step). A caller that passes no lengths (padded micro-batches, any code that does not know them)
gets transformers' sdpa under the mask transformers builds from the position ids: a missing length costs speed,
never correctness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PACKED_SDPA = "rl_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, T, D]
    key: torch.Tensor,  # [B, kv_heads, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sample_lengths: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature; returns [B, T, heads, D]. `sample_lengths`: the lengths of the samples
    of one packed row (B = 1), in order; without them, transformers' sdpa under `attention_mask`."""
    if sample_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or sum(sample_lengths) != query.shape[2]:
        raise ValueError(f"sample_lengths {list(sample_lengths)} (sum {sum(sample_lengths)}) do not describe one "
                         f"packed row of {query.shape[2]} tokens (batch {query.shape[0]})")
    gqa = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
        for q, k, v in zip(query.split(sample_lengths, 2), key.split(sample_lengths, 2),
                           value.split(sample_lengths, 2))
    ]
    return torch.cat(parts, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
# transformers builds sdpa's mask for every forward: it is what a caller without lengths is attended under.
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)


def transformers_attention(attn_implementation: str, compile_blocks: bool, device: torch.device) -> str:
    """The name the model is loaded with for rl's `attn_implementation`: rl's packed sdpa on CPU only. On an H200
    it was 31% faster than transformers' masked sdpa for a bare model's step, but halved the FSDP trainer's tokens/s
    (benchmarks/gpu_trainer.py, not yet explained): GPUs keep transformers' sdpa (or flex_attention) until it is."""
    packed = attn_implementation == "sdpa" and not compile_blocks and device.type == "cpu"
    return PACKED_SDPA if packed else attn_implementation
