"""Linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next) over packed rows, each sample from a zero state.

A packed row holds several samples one after another. Its attention layers keep them apart by the row's sample
lengths (trainer/attention.py). A linear-attention layer instead carries a causal convolution and a recurrent state
along the row: unseparated, each sample would start from the state the previous sample left, which inference never
computed. transformers' torch kernels take no sequence boundaries (fla's take `cu_seqlens`, which the torch path
ignores), so the row's samples are laid side by side, right-padded into one batch [samples, longest, hidden]: each
starts from zero as in inference, the padding follows every real token and so changes none of them, and the layer
still runs once per row. Rows of one sample, and padded micro-batches, pass through unchanged.

`separate_samples` wraps each such layer's forward on the meta device, before sharding; the lengths reach it as the
`sample_lengths` keyword that the trainer's forward passes for packed rows (trainer/model.py: `forward_scores`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence


def is_linear_attention(module: nn.Module) -> bool:
    """A Gated DeltaNet layer: a short causal convolution and per-head decays (`A_log`)."""
    return hasattr(module, "A_log") and hasattr(module, "conv1d")


def separate_samples(model: nn.Module) -> int:
    """Make every linear-attention layer compute each sample of a packed row on its own; how many there are."""
    layers = [m for m in model.modules() if is_linear_attention(m)]
    for layer in layers:
        layer.forward = functools.partial(forward_by_sample, layer.forward)
    model.rl_linear_attention = len(layers)
    return len(layers)


def has_linear_attention(model: nn.Module) -> bool:
    return getattr(model, "rl_linear_attention", 0) > 0


def forward_by_sample(forward, hidden_states: torch.Tensor, *args, sample_lengths: tuple[int, ...] | None = None,
                      **kwargs) -> torch.Tensor:
    """`forward` (the layer's own) on one packed row [1, T, H] as a right-padded batch of its samples; [1, T, H]."""
    if sample_lengths is None or len(sample_lengths) == 1:
        return forward(hidden_states, *args, **kwargs)
    if hidden_states.shape[0] != 1 or sum(sample_lengths) != hidden_states.shape[1]:
        raise ValueError(f"sample_lengths {list(sample_lengths)} (sum {sum(sample_lengths)}) do not describe one "
                         f"packed row of {hidden_states.shape[1]} tokens (batch {hidden_states.shape[0]})")
    samples = pad_sequence(hidden_states[0].split(list(sample_lengths)), batch_first=True)  # [N, longest, H]
    lengths = torch.tensor(sample_lengths, device=samples.device)
    real = torch.arange(samples.shape[1], device=samples.device) < lengths[:, None]  # [N, longest]
    kwargs["attention_mask"] = real.to(samples.dtype)  # zeroes the padding's inputs (transformers' own use of it)
    out = forward(samples, *args, **kwargs)  # [N, longest, H]
    return out[real].unsqueeze(0)
