"""vLLM: Gated DeltaNet (the linear attention of Qwen3.5 and Qwen3-Next) served in float32 on CPU.

vLLM 0.32's CPU path for GDN (`ops/cpu/gdn_attention.py: cpu_gdn_attention_core`) asserts bfloat16 and its three C++
kernels (gating, chunked delta rule, one-token update) accept nothing else, so a hybrid model could be served on CPU
only in bf16: emulated on CPUs without AVX-512 BF16 (slower than float32) and never equal to a float32 trainer. This
computes the same core in float32 with transformers' torch reference of the delta rule, the functions rl's trainer
runs without fla kernels, so what is served and what is trained agree to rounding:

    g_t = -exp(A_log) * softplus(a_t + dt_bias)       beta_t = sigmoid(b_t)         # per value head
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T      o_t = S_t^T q_t / sqrt(d_k)   # q, k L2-normed

The causal conv1d before it is vLLM's own torch (prefill) and vectorised (decode) path, which take float32. The
recurrent state S [slots, heads, d_k, d_v] lives in vLLM's state cache (`layer.kv_cache[1]`) as its kernels keep it;
a prefill starts from zero or from the slot's state (vLLM's `has_initial_state`: a prefix-cache hit or a chunked
prefill's next chunk) and leaves its last state there, a decode step updates its slot in place. bfloat16 inputs go
to vLLM's kernels as before, and so does speculative decoding, which rl does not configure.

Applied in every vLLM process by a general plugin (`gdn_float32_on_cpu`) where the inference server set `GDN_ENV`
(a hybrid model served in float32 on a CPU host), before vLLM registers the op, which reads the function then.
"""

from __future__ import annotations

import os

from rl.patches.targets import patch_target

GDN_ENV = "RL_VLLM_CPU_GDN_FLOAT32"


def gdn_float32_on_cpu() -> None:
    """The general plugin: vLLM's CPU GDN op computes float32 inputs with `float32_core`, where `GDN_ENV` is set."""
    if os.environ.get(GDN_ENV) != "1":
        return
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.utils.torch_utils import LayerNameType

    core = patch_target(gdn_attention, "cpu_gdn_attention_core", "vllm")
    if getattr(core, "rl_float32", False):
        return

    def cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
        if mixed_qkv.dtype != torch.float32:
            return core(mixed_qkv, b, a, core_attn_out, layer_name)
        layer, metadata = _layer_and_metadata(gdn_attention, layer_name)
        if metadata is not None and metadata.num_actual_tokens:
            float32_core(layer, metadata, mixed_qkv, b, a, core_attn_out)

    # Evaluated types, not this module's strings: torch infers the op's schema from them.
    cpu_gdn_attention_core.__annotations__ = {**dict.fromkeys(("mixed_qkv", "b", "a", "core_attn_out"), torch.Tensor),
                                              "layer_name": LayerNameType, "return": None}
    cpu_gdn_attention_core.rl_float32 = True
    gdn_attention.cpu_gdn_attention_core = cpu_gdn_attention_core


def _layer_and_metadata(gdn_attention, layer_name):
    """The GDN layer the op runs for and its attention metadata (None in vLLM's profiling run), as vLLM's op finds
    them."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    layer = context.no_compile_layers[gdn_attention._resolve_layer_name(layer_name)]
    metadata = context.attn_metadata
    return layer, None if metadata is None else metadata[layer.prefix]


def float32_core(layer, metadata, mixed_qkv, b, a, out) -> None:
    """The GDN core of one forward step, decodes first then prefills (vLLM's token order), into `out` [T, heads,
    d_v]."""
    if metadata.spec_sequence_masks is not None or metadata.num_accepted_tokens is not None:
        raise NotImplementedError("rl's float32 GDN on CPU does not take speculative decoding: serve in bfloat16")
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_state = layer.kv_cache[0]  # [slots, dim, width - 1] once transposed
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), -1)  # [dim, width]
    slots, heads, d_v, d_k = layer.kv_cache[1].size()
    state = layer.kv_cache[1].view(slots, heads, d_k, d_v)  # the layout vLLM's kernels keep
    indices = metadata.non_spec_state_indices_tensor
    starts = metadata.non_spec_query_start_loc
    decodes, decode_tokens = metadata.num_decodes, metadata.num_decode_tokens
    if decodes:
        out[:decode_tokens] = _decode(layer, mixed_qkv[:decode_tokens], b[:decode_tokens], a[:decode_tokens],
                                      conv_state, weight, state, indices[:decodes])
    if metadata.num_prefills:
        end = decode_tokens + metadata.num_prefill_tokens
        out[decode_tokens:end] = _prefill(
            layer, mixed_qkv[decode_tokens:end], b[decode_tokens:end], a[decode_tokens:end], conv_state, weight, state,
            indices[decodes:decodes + metadata.num_prefills], starts[decodes:] - decode_tokens,
            metadata.has_initial_state[decodes:decodes + metadata.num_prefills])


def _decode(layer, qkv, b, a, conv_state, weight, state, indices):
    """One token per sequence, all sequences at once: [N, heads, d_v]."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

    qkv = causal_conv1d_update_cpu(x=qkv, conv_state=conv_state, weight=weight, bias=layer.conv1d.bias,
                                   activation=layer.activation, conv_state_indices=indices)
    query, key, value = _heads(layer, qkv, batch=qkv.shape[0])  # [N, 1, heads, d]
    g, beta = _gates(layer, a, b)
    slots = indices.long()
    attended, last = torch_recurrent_gated_delta_rule(
        query, key, value, g=g.unsqueeze(1), beta=beta.unsqueeze(1), initial_state=state[slots],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    state[slots] = last.to(state.dtype)
    return attended.squeeze(1)


def _prefill(layer, qkv, b, a, conv_state, weight, state, indices, starts, has_initial_state):
    """Each prefilled sequence from its slot's state or from zero, in chunks as the trainer computes: [T, heads,
    d_v]."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

    qkv = causal_conv1d_fn_cpu(x=qkv.transpose(0, 1), weight=weight, bias=layer.conv1d.bias, conv_states=conv_state,
                               query_start_loc=starts, cache_indices=indices, has_initial_state=has_initial_state,
                               activation=layer.activation).transpose(0, 1)
    g, beta = _gates(layer, a, b)
    parts = []
    bounds = starts.tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        slot = int(indices[i])
        query, key, value = _heads(layer, qkv[start:end], batch=1)  # [1, L, heads, d]
        initial = state[slot:slot + 1] if bool(has_initial_state[i]) else None
        attended, last = torch_chunk_gated_delta_rule(
            query, key, value, g=g[None, start:end], beta=beta[None, start:end], initial_state=initial,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        state[slot] = last[0].to(state.dtype)
        parts.append(attended[0])
    return torch.cat(parts)


def _heads(layer, qkv, batch: int):
    """q, k, v of `batch` sequences of equal length [batch, L, heads, d]; q and k repeated over the value heads
    that share them, as transformers does."""
    query, key, value = layer.rearrange_mixed_qkv(qkv)  # [1, T, heads, d]
    query, key, value = (x.reshape(batch, -1, *x.shape[2:]) for x in (query, key, value))
    repeats = value.shape[2] // query.shape[2]
    if repeats > 1:
        query, key = query.repeat_interleave(repeats, dim=2), key.repeat_interleave(repeats, dim=2)
    return query, key, value


def _gates(layer, a, b):
    """The decay g (float32) and the write strength beta of each token and value head, [T, heads], as transformers
    computes them."""
    import torch.nn.functional as F

    return -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias), b.sigmoid()
