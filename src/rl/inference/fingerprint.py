"""The fingerprint that proves what vLLM serves, and its comparison with the files'.

Why a checksum of vLLM's parameters is not enough: on CPU, vLLM packs every linear weight into a
kernel handle (oneDNN / sgl) and leaves an empty parameter behind, and its in-place reload only logs
a warning for a layer it could not load (reloading a tied-embedding checkpoint without
`lm_head.weight` leaves the LM head's packed kernel on the old weights, so logits match neither
model). So we fingerprint *what the kernels compute*:

- each matrix W [out, in] behind a kernel is read back through that kernel with K one-hot probes,
  kernel(e_j) = W[:, j] bit for bit (products by 1 and sums of zeros are exact), and with one dense
  random probe x, kernel(x) ~ W @ x, which involves every element;
- parameters used directly (norms, biases, the input embedding) get the same fingerprint from the
  tensor itself.

A fingerprint, keyed by checkpoint tensor name, is (exact: W[:, cols] or the whole 1-D tensor,
dense: W @ x). The same fingerprint is computed from the safetensors files (`FileTally`,
`checkpoint_fingerprint`; no vLLM needed). Verification passes when the names match, every exact part is equal
and every dense part agrees within rounding; `weights_checksum` then hashes every tensor of the files. What it
proves: every tensor of the files reaches the kernel that serves it, K columns of each matrix are served bit
for bit (so even a tiny training update that was not applied is caught), and W @ x agrees within
rounding along a random x (a stale or garbage head, row, column or shard is caught; a small change
confined to unsampled columns is not). Cost: a (K + 1)-row product per matrix of the files as its tensors pass
to the reload, then a (K + 1)-row product per served layer, after the reload.

Tensor parallel: each worker fingerprints what it serves, its shard of every tensor (rl/inference/sharding.py), and
the files' side cuts the same shard out of each whole tensor as it passes (`FileTally(shards=...)`), so every
worker proves its own part: a wrong row of any shard fails on the worker that serves it.

An MoE's experts are fused and, on CPU, re-packed for vLLM's kernel: they are read back per expert from the buffers
the kernel reads, and checked against what the kernel computes (rl/inference/experts.py).

With LoRA on (`--enable-lora`), vLLM wraps each layer it can adapt and keeps the original as `<name>.base_layer`:
the fingerprint reads the base layer under its checkpoint name, so the base model verifies as without LoRA.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rl.inference.experts import is_experts, kernel_disagreements, served_experts
from rl.inference.reading import checkpoint_tensors
from rl.inference.sharding import (
    Part, Pieces, Shard, input_shard, linear_attention_shards, output_parts, tp_rank_size, vocab_rows,
)
from rl.weights.digest import TensorDigest
PROBE_COLUMNS = 4
ROW_CHUNK = 8192  # rows of a matrix cast to float32 at a time, to bound the memory of a fingerprint
# Largest dense-probe error, relative to max_i sum_j |W_ij x_j|, that still counts as rounding.
DENSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LORA_BASE = ".base_layer"  # where vLLM's LoRA wrapper keeps the layer it adapts


@dataclass
class Fingerprint:
    exact: torch.Tensor  # [K, out] sampled columns W[:, cols].T of a matrix, or a whole 1-D tensor
    dense: torch.Tensor | None  # [out] W @ x in float32, for a matrix
    shape: tuple[int, ...]  # of the whole tensor in checkpoint layout
    scale: float = 0.0  # max_i sum_j |W_ij x_j|: the size of the dense probe's terms (file side)
    shard: Shard | Pieces | None = None  # the part of the tensor fingerprinted (a tensor-parallel worker's); None: all


@functools.lru_cache(maxsize=64)
def probe_inputs(n: int, dtype: torch.dtype, device="cpu") -> tuple[list[int], torch.Tensor]:
    """K one-hot rows then one dense row, [K + 1, n]; the same for every matrix with n inputs (cached:
    a model has a few input sizes; callers must not modify the tensor)."""
    generator = torch.Generator().manual_seed(n)
    cols = sorted(torch.randperm(n, generator=generator)[:PROBE_COLUMNS].tolist())
    x = torch.zeros(len(cols) + 1, n, dtype=dtype)
    x[torch.arange(len(cols)), cols] = 1
    x[-1] = torch.randn(n, generator=generator).to(dtype)
    return cols, x.to(device)


@functools.lru_cache(maxsize=64)
def _file_probes(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`probe_inputs` in float32 [K + 1, n] and the dense probe's magnitudes |x| [n]."""
    _, x = probe_inputs(n, torch.float32, device)
    return x, x[-1].abs()


def tensor_fingerprint(w: torch.Tensor, dtype: torch.dtype) -> Fingerprint:
    """Fingerprint of a tensor as stored (a file tensor, or a parameter the model uses directly), or of the part of
    one served here (`part_fingerprint` labels it).

    Computed where `w` lives, in row chunks; only the small results are brought to the CPU.
    """
    w, shape = w.detach(), tuple(w.shape)
    if w.ndim == 1:
        return Fingerprint(exact=w.to("cpu", dtype).clone(), dense=None, shape=shape)
    w = w.flatten(1)  # a convolution's [out, in, width] as a matrix [out, in * width]
    probes, magnitudes = _file_probes(w.shape[1], w.device)
    ys, scale = [], 0.0
    for rows in w.split(ROW_CHUNK):
        rows = rows.to(dtype).float()  # cast like the served copy, then compute in float32
        # x W^T as a linear layer computes it ([K + 1, rows]; on CPU much faster than W @ x^T for K + 1 rows).
        # One-hot rows give exact columns, as in the kernel's product.
        ys.append(torch.nn.functional.linear(probes, rows))
        scale = max(scale, torch.mv(rows.abs(), magnitudes).max().item())
    y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)).cpu()
    return Fingerprint(exact=y[:-1].to(dtype), dense=y[-1], shape=shape, scale=scale)


def kernel_fingerprint(y: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int], shard: Shard | None
                       ) -> Fingerprint:
    """Fingerprint from a kernel's output on `probe_inputs`, y [K + 1, out], for its `shard` of a tensor of `shape`."""
    y = y.detach().to("cpu", dtype)
    return Fingerprint(exact=y[:-1].contiguous(), dense=y[-1].float(), shape=shape, shard=shard)



def shape_mismatches(served: dict[str, tuple], files: dict[str, tuple]) -> list[str]:
    """What keeps `files` from being a checkpoint of the served model: missing, extra or reshaped tensors."""
    mismatched = [f"not served: {n}" for n in sorted(files.keys() - served.keys())]
    mismatched += [f"not in the files: {n}" for n in sorted(served.keys() - files.keys())]
    return mismatched + [f"{n}: served shape {served[n]}, files {files[n]}"
                         for n in sorted(files.keys() & served.keys()) if served[n] != files[n]]


class FileTally:
    """The fingerprint of every tensor of a checkpoint, cast to the served dtype, and `weights_checksum`
    (`TensorDigest`: of every tensor's name, dtype, shape and bytes); both taken as the tensors pass on
    their way to the reload, so the files are read once. Once the served fingerprint matches, the checksum names
    what is served; it covers every element (the fingerprint samples a few columns exactly).

    `checksum`: the files' checksum where the server already took it from these very bytes as it checked them (a
    staged step, sealed since: rl.inference.staging), so no worker hashes the whole model again while generation
    is held; it then covers the files' own tensors, not a tied head the reload adds from the embedding."""

    def __init__(self, dtype: torch.dtype, device="cpu", shards: dict[str, Shard | None] | None = None,
                 checksum: str | None = None):
        self.dtype, self.device, self.shards = dtype, device, shards or {}
        self.prints: dict[str, Fingerprint] = {}
        self.digest, self.known = (TensorDigest(), None) if checksum is None else (None, checksum)
        self.seconds = 0.0
        self.device_bytes = 0  # moved to the device here: a tensor served whole, or the shard fingerprinted

    def through(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, fingerprinted on the way (on the device that serves them). A tensor served whole here goes to
        the device once and on to the reload from there; of one this worker serves a shard of, only the shard goes,
        to be fingerprinted, and the reload gets the host tensor, from which vLLM's loader copies the same shard:
        each tensor-parallel worker moves its own part to its GPU, not the whole model."""
        for name, tensor in tensors:
            start = time.perf_counter()
            if self.digest is not None:
                self.digest.update(name, tensor)
            shard = self.shards.get(name)
            if shard is None:
                tensor = tensor.to(self.device)
                self.prints[name] = tensor_fingerprint(tensor, self.dtype)
                self.device_bytes += tensor.numel() * tensor.element_size()
            else:
                part = shard.of(tensor).to(self.device)
                self.prints[name] = part_fingerprint(part, self.dtype, tuple(tensor.shape), shard)
                self.device_bytes += part.numel() * part.element_size()
                del part
            self.seconds += time.perf_counter() - start
            yield name, tensor

    @property
    def checksum(self) -> str:
        return self.known if self.digest is None else self.digest.hexdigest()


def checkpoint_fingerprint(path: str | Path, dtype: torch.dtype, tied: bool) -> tuple[dict[str, Fingerprint], str]:
    """The fingerprint and checksum of a model directory's files (see FileTally)."""
    tally = FileTally(dtype)
    for _ in tally.through(checkpoint_tensors(path, tied)):
        pass
    return tally.prints, tally.checksum


def compare(served: dict[str, Fingerprint], files: dict[str, Fingerprint], dtype: torch.dtype) -> dict:
    """Compare served with file fingerprints; the report says what differs and by how much.

    `mismatched` lists tensors that differ in structure (missing, extra, other shape): the files
    are not a checkpoint of the served model. `differing` lists tensors whose values differ.
    """
    mismatched = shape_mismatches({n: p.shape for n, p in served.items()}, {n: p.shape for n, p in files.items()})
    differing, max_exact, max_dense = [], 0.0, 0.0
    for name in sorted(files.keys() & served.keys()):
        s, f = served[name], files[name]
        if s.shape != f.shape:
            continue
        exact = 0.0 if torch.equal(s.exact, f.exact) else (s.exact.float() - f.exact.float()).abs().max().item()
        dense = 0.0 if f.dense is None else (s.dense - f.dense).abs().max().item() / max(f.scale, 1e-30)
        max_exact, max_dense = max(max_exact, exact), max(max_dense, dense)
        if not (exact == 0 and dense <= DENSE_TOLERANCE.get(dtype, 2e-2)):  # NaN differs too
            differing.append(f"{name}: exact part differs by {exact:.3g}, dense probe by {dense:.3g}")
    return {
        "ok": not mismatched and not differing,
        "tensors": len(files),
        "max_exact_diff": max_exact,
        "max_dense_rel_err": max_dense,
        "mismatched": mismatched[:20],
        "differing": differing[:20],
    }


def served_fingerprint(model: torch.nn.Module, dtype: torch.dtype, device) -> dict[str, Fingerprint]:
    """Fingerprint of what a vLLM model computes on this worker (its shard of each tensor), by checkpoint name."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {})
    prints: dict[str, Fingerprint] = {}
    convolutions = {f"{p}.conv1d" for p, m in model.named_modules() if is_linear_attention(m)}
    for prefix, module in model.named_modules():
        prefix = prefix.replace(LORA_BASE + ".", ".").removesuffix(LORA_BASE)  # a LoRA-wrapped layer's own name
        if isinstance(module, ParallelLMHead):
            prints |= _head_prints(prefix, module, dtype, device)
            continue
        if isinstance(module, LinearBase):
            if prefix not in convolutions:  # a linear attention's convolution is read with its layer (below)
                prints |= _kernel_prints(prefix, module, dtype, packed, device)
            continue
        if is_linear_attention(module):
            prints |= _linear_attention_prints(prefix, module, dtype)
            continue
        if is_experts(module):
            prints |= _expert_prints(prefix.removesuffix(".routed_experts"), module, dtype)
            continue
        for pname, param in module.named_parameters(recurse=False):
            shard = None
            if isinstance(module, VocabParallelEmbedding):  # [padded vocab part, hidden]: padding is never looked up
                rows, shard = vocab_rows(module)
                param = param[:rows]
            shape = tuple(param.shape) if shard is None else (module.org_vocab_size, *param.shape[1:])
            prints[f"{prefix}.{pname}"] = part_fingerprint(param, dtype, shape, shard)
    return {checkpoint_name(model, name): fingerprint for name, fingerprint in prints.items()}


def checkpoint_name(model: torch.nn.Module, name: str) -> str:
    """A vLLM module's tensor under its checkpoint name, where a vision-language model renames prefixes as it loads
    (`language_model.model.` is `model.language_model.`, `visual.` is `model.visual.`). Only those: a causal LM's
    mapper may also take another layout's names in (Qwen3.5's text model reads a VLM's `model.language_model.`), and
    its own checkpoints' names are its modules'."""
    if not getattr(model, "supports_multimodal", False):
        return name
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    for original, served in (getattr(mapper, "orig_to_new_prefix", None) or {}).items():
        if served and name.startswith(served):
            return original + name.removeprefix(served)
    return name


def part_fingerprint(part: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], shard: Shard | None
                     ) -> Fingerprint:
    """The fingerprint of the part of a tensor served here, labelled with the whole tensor's shape and the part's
    shard (None: the part is the whole tensor)."""
    return replace(tensor_fingerprint(part, dtype), shape=shape, shard=shard)


def _head_prints(prefix: str, module, dtype: torch.dtype, device) -> dict:
    """The LM head read back through its kernel: its real vocabulary rows served here."""
    rows, shard = vocab_rows(module)
    _, x = probe_inputs(module.embedding_dim, dtype, device)
    y = module.quant_method.apply(module, x)[:, :rows]  # [K + 1, rows], no bias
    return {f"{prefix}.weight": kernel_fingerprint(y, dtype, (module.org_vocab_size, module.embedding_dim), shard)}


def _kernel_prints(prefix: str, module, dtype: torch.dtype, packed: dict, device) -> dict:
    """Read a kernel-held weight back through the layer's own `quant_method.apply`, as in forward: each checkpoint
    tensor fused into the layer, its part served here."""
    in_local, in_shard = input_shard(module)
    _, x = probe_inputs(in_local, dtype, device)
    y = module.quant_method.apply(module, x)  # [K + 1, out served here], no bias
    parts = output_parts(module)
    names = _fused_names(prefix, packed, len(parts))
    if len(names) < len(parts):  # a checkpoint tensor split over several of the layer's parts
        parts = _joined_parts(parts, names)
    prints = {}
    for name, part, y_part in zip(names, parts, y.split([p.local for p in parts], dim=-1), strict=True):
        shard = _weight_shard(part, in_shard)
        prints[f"{name}.weight"] = kernel_fingerprint(y_part, dtype, (part.full, module.input_size), shard)
    bias = getattr(module, "bias", None)
    if bias is not None:
        for name, part, b in zip(names, parts, bias.split([p.local for p in parts]), strict=True):
            prints[f"{name}.bias"] = part_fingerprint(b, dtype, (part.full,), part.shard)
    return prints


def is_linear_attention(module) -> bool:
    """vLLM's Gated DeltaNet layer (Qwen3.5, Qwen3-Next): a convolution and per-head decays of its own."""
    return hasattr(module, "A_log") and hasattr(module, "conv1d")


def _linear_attention_prints(prefix: str, module, dtype: torch.dtype) -> dict:
    """A Gated DeltaNet layer's own tensors, used as they are: the convolution's weight (vLLM keeps it [rows, 1, width]
    in float32, [rows, width] in bf16; read in the checkpoint's layout), `A_log` and `dt_bias`, each the part this
    worker serves. On CPUs with bf16 instructions vLLM packs the convolution for its kernel and keeps the plain copy
    it falls back to (`_cpu_unpacked_conv_weight`): that copy is what is read there."""
    shards = linear_attention_shards(module)
    _, size = tp_rank_size(module)
    prints = {}
    for name, shard in shards.items():
        param = module.get_parameter(name)
        if name == "conv1d.weight":
            param = getattr(module.conv1d, "_cpu_unpacked_conv_weight", param)
            param = param.reshape(param.shape[0], 1, -1)
        shape = tuple(param.shape) if shard is None else (param.shape[0] * size, *param.shape[1:])
        prints[f"{prefix}.{name}"] = part_fingerprint(param, dtype, shape, shard)
    return prints


def _expert_prints(prefix: str, module, dtype: torch.dtype) -> dict:
    """An MoE layer's experts read back from the buffers its kernel reads (rl/inference/experts.py), each under its
    checkpoint name; an expert whose kernel does not compute with what was read back gets a NaN fingerprint, which
    no file matches."""
    served = served_experts(prefix, module)
    wrong = kernel_disagreements(prefix, module, served)
    prints = {}
    for name, (part, shape, shard) in served.items():
        fingerprint = part_fingerprint(part, dtype, shape, shard)
        if name.rpartition(".")[0].rpartition(".")[0] in wrong:
            fingerprint.dense = torch.full_like(fingerprint.dense, float("nan"))
        prints[name] = fingerprint
    return prints


def _weight_shard(part, in_shard: Shard | None) -> Shard | None:
    """A weight's shard: its output rows (column-parallel) or its input columns (row-parallel); never both."""
    assert part.shard is None or in_shard is None, "a layer splits either its outputs or its inputs"
    return part.shard or in_shard


def _fused_names(prefix: str, packed: dict, count: int) -> list[str]:
    """The checkpoint names of a layer's fused tensors (qkv_proj -> q/k/v_proj), or its own name."""
    parent, _, leaf = prefix.rpartition(".")
    shards = packed.get(leaf)
    if not shards or count == 1 and len(shards) != 1:
        return [prefix] if count == 1 else [f"{prefix}.{i}" for i in range(count)]
    if len(shards) < count and not all(shard in SPLIT_TENSORS for shard in shards[:-1]):
        return [f"{prefix}.{i}" for i in range(count)]  # named by part: no file matches, the proof fails naming them
    return [f"{parent}.{shard}" for shard in shards]


SPLIT_TENSORS = {"in_proj_qkv": 3}
"""Checkpoint tensors vLLM splits over several parts of a fused layer: Gated DeltaNet's (Qwen3.5, Qwen3-Next) q, k and
v rows of `in_proj_qkv` are three parts of `in_proj_qkvz`, beside `in_proj_z`."""


def _joined_parts(parts: list[Part], names: list[str]) -> list[Part]:
    """Consecutive `parts` joined into one part per checkpoint tensor (`SPLIT_TENSORS`, or all of them for one name);
    with tensor parallelism its shard is each part's rows, placed after the parts before it in the tensor
    (`Pieces`)."""
    joined, start = [], 0
    for name in names:  # one name for all of them: a fused checkpoint tensor (a vision tower's attn.qkv)
        size = SPLIT_TENSORS.get(name.rpartition(".")[2], 1) if len(names) > 1 else len(parts)
        group = parts[start:start + size]
        start += len(group)
        local, full = sum(p.local for p in group), sum(p.full for p in group)
        if all(p.shard is None for p in group):
            joined.append(Part(local, full, None))
            continue
        shards, offset = [], 0
        for p in group:
            shards.append(Shard(0, offset + p.shard.start, p.shard.length))
            offset += p.full
        joined.append(Part(local, full, shards[0] if len(shards) == 1 else Pieces(tuple(shards))))
    return joined
