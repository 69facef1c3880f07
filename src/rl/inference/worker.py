"""vLLM worker extension: reload weights in place from a step directory, and prove what is served.

Loaded into every vLLM worker with `--worker-extension-cls rl.inference.worker.WeightSyncExtension`;
the server calls its methods with `engine_client.collective_rpc("rl_load_weights", args=(path,))`.

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
dense: W @ x). The same fingerprint is computed from the safetensors files (`checkpoint_fingerprint`,
no vLLM needed). Verification passes when the names match, every exact part is equal and every
dense part agrees within rounding. `weights_checksum` hashes the exact parts, so the served and the
file checksum are equal exactly when those are. What it proves: every tensor of the files reaches
the kernel that serves it, K columns of each matrix are served bit for bit (so even a tiny training
update that was not applied is caught), and W @ x agrees within rounding along a random x (a stale
or garbage head, row, column or shard is caught; a small change confined to unsampled columns is not).
Cost: one pass over the files plus a (K + 1)-row product per layer; the files are read once more by
the reload itself.

Tied embeddings: vLLM's Qwen3 loader does not skip `lm_head.weight`, and its in-place reload leaves
the tied LM head's packed kernel stale when the files lack that tensor. `checkpoint_tensors` yields
`lm_head.weight` = `model.embed_tokens.weight` for a tied model whose files lack it, so a tied
checkpoint reloads correctly either way; the verification would catch it if it did not.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

PROBE_COLUMNS = 4
ROW_CHUNK = 8192  # rows of a matrix cast to float32 at a time, to bound the memory of a fingerprint
# Largest dense-probe error, relative to max_i sum_j |W_ij x_j|, that still counts as rounding.
DENSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@dataclass
class Fingerprint:
    exact: torch.Tensor  # [K, out] sampled columns W[:, cols].T of a matrix, or a whole 1-D tensor
    dense: torch.Tensor | None  # [out] W @ x in float32, for a matrix
    shape: tuple[int, ...]  # of the tensor in checkpoint layout
    scale: float = 0.0  # max_i sum_j |W_ij x_j|: the size of the dense probe's terms (file side)


def probe_inputs(n: int, dtype: torch.dtype, device="cpu") -> tuple[list[int], torch.Tensor]:
    """K one-hot rows then one dense row, [K + 1, n]; the same for every matrix with n inputs."""
    generator = torch.Generator().manual_seed(n)
    cols = sorted(torch.randperm(n, generator=generator)[:PROBE_COLUMNS].tolist())
    x = torch.zeros(len(cols) + 1, n, dtype=dtype)
    x[torch.arange(len(cols)), cols] = 1
    x[-1] = torch.randn(n, generator=generator).to(dtype)
    return cols, x.to(device)


def tensor_fingerprint(w: torch.Tensor, dtype: torch.dtype) -> Fingerprint:
    """Fingerprint of a tensor as stored (a file tensor, or a parameter the model uses directly).

    Computed where `w` lives, in row chunks; only the small results are brought to the CPU.
    """
    w = w.detach()
    if w.ndim == 1:
        return Fingerprint(exact=w.to("cpu", dtype).clone(), dense=None, shape=tuple(w.shape))
    cols, x = probe_inputs(w.shape[1], dtype, w.device)
    x = x[-1].float()
    dense, scale = [], 0.0
    for rows in w.split(ROW_CHUNK):
        rows = rows.to(dtype).float()  # cast like the served copy, then compute in float32
        dense.append(rows @ x)
        scale = max(scale, (rows.abs() @ x.abs()).max().item())
    exact = w[:, cols].to(dtype).T.contiguous().cpu()
    return Fingerprint(exact=exact, dense=torch.cat(dense).cpu(), shape=tuple(w.shape), scale=scale)


def kernel_fingerprint(y: torch.Tensor, dtype: torch.dtype, in_features: int) -> Fingerprint:
    """Fingerprint from a kernel's output on `probe_inputs`, y [K + 1, out]."""
    y = y.detach().to("cpu", dtype)
    return Fingerprint(exact=y[:-1].contiguous(), dense=y[-1].float(), shape=(y.shape[1], in_features))


def checkpoint_tensors(path: str | Path, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files in `path`, plus the tied LM head if it is missing."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names, embedding = set(), None
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = handle.get_tensor(name)
                names.add(name)
                embedding = tensor if name == EMBEDDING else embedding
                yield name, tensor
    if tied and TIED_HEAD not in names and embedding is not None:
        yield TIED_HEAD, embedding


def checkpoint_fingerprint(path: str | Path, dtype: torch.dtype, tied: bool) -> dict[str, Fingerprint]:
    """Fingerprint of every tensor in a Hugging Face safetensors directory, cast to the served dtype."""
    return {name: tensor_fingerprint(t, dtype) for name, t in checkpoint_tensors(path, tied)}


def checksum(prints: dict[str, Fingerprint]) -> str:
    """sha256 over names and exact parts: equal for served and file fingerprints iff those are."""
    digest = hashlib.sha256()
    for name in sorted(prints):
        digest.update(name.encode() + b"\0")
        digest.update(prints[name].exact.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def compare(served: dict[str, Fingerprint], files: dict[str, Fingerprint], dtype: torch.dtype) -> dict:
    """Compare served with file fingerprints; the report says what differs and by how much.

    `mismatched` lists tensors that differ in structure (missing, extra, other shape): the files
    are not a checkpoint of the served model. `differing` lists tensors whose values differ.
    """
    mismatched = [f"not served: {n}" for n in sorted(files.keys() - served.keys())]
    mismatched += [f"not in the files: {n}" for n in sorted(served.keys() - files.keys())]
    differing, max_exact, max_dense = [], 0.0, 0.0
    for name in sorted(files.keys() & served.keys()):
        s, f = served[name], files[name]
        if s.shape != f.shape:
            mismatched.append(f"{name}: served shape {s.shape}, files {f.shape}")
            continue
        exact = (s.exact.float() - f.exact.float()).abs().max().item()
        dense = 0.0 if f.dense is None else (s.dense - f.dense).abs().max().item() / max(f.scale, 1e-30)
        max_exact, max_dense = max(max_exact, exact), max(max_dense, dense)
        if exact > 0 or dense > DENSE_TOLERANCE.get(dtype, 2e-2):
            differing.append(f"{name}: exact part differs by {exact:.3g}, dense probe by {dense:.3g}")
    return {
        "ok": not mismatched and not differing,
        "checksum": checksum(served),
        "file_checksum": checksum(files),
        "tensors": len(files),
        "max_exact_diff": max_exact,
        "max_dense_rel_err": max_dense,
        "mismatched": mismatched[:20],
        "differing": differing[:20],
    }


def served_fingerprint(model: torch.nn.Module, dtype: torch.dtype, vocab_size: int, device) -> dict[str, Fingerprint]:
    """Fingerprint of what a vLLM model computes (tensor parallel size 1), by checkpoint name."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {})
    prints: dict[str, Fingerprint] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            prints |= _kernel_prints(prefix, module, dtype, vocab_size, packed, device)
            continue
        for pname, param in module.named_parameters(recurse=False):
            if isinstance(module, VocabParallelEmbedding):
                param = param[:vocab_size]  # [padded vocab, hidden]: padding rows are never looked up
            prints[f"{prefix}.{pname}"] = tensor_fingerprint(param, dtype)
    return prints


def _kernel_prints(prefix: str, module, dtype: torch.dtype, vocab_size: int, packed: dict, device) -> dict:
    """Read a kernel-held weight back through the layer's own `quant_method.apply`, as in forward."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    _, x = probe_inputs(module.input_size, dtype, device)
    y = module.quant_method.apply(module, x)  # [K + 1, out], no bias
    if isinstance(module, ParallelLMHead):
        y = y[:, :vocab_size]
    prints = {
        f"{name}.weight": kernel_fingerprint(part, dtype, module.input_size)
        for name, part in _unfuse(prefix, module, y, packed)
    }
    if getattr(module, "bias", None) is not None:
        for name, part in _unfuse(prefix, module, module.bias, packed):
            prints[f"{name}.bias"] = tensor_fingerprint(part, dtype)
    return prints


def _unfuse(prefix: str, module, y: torch.Tensor, packed: dict) -> list[tuple[str, torch.Tensor]]:
    """Split a fused layer's outputs by checkpoint name (qkv_proj -> q/k/v_proj), along the last dim."""
    parent, _, leaf = prefix.rpartition(".")
    shards = packed.get(leaf)
    if not shards:
        return [(prefix, y)]
    parts = y.split(list(module.output_sizes), dim=-1)
    return [(f"{parent}.{shard}", part) for shard, part in zip(shards, parts, strict=True)]


class WeightSyncExtension:
    """Mixed into vLLM's worker class, so `self` is the worker; reach methods with `collective_rpc`.

    Methods return plain dicts (they cross a process boundary) and report a failure in the dict, with
    the traceback in this worker's log, so the server can roll back and answer with the reason.
    """

    def rl_verify_weights(self, path: str) -> dict:
        """Compare what this worker serves with the safetensors files in `path`."""
        try:
            return self._rl_compare(self._rl_files(path))
        except Exception as error:
            logger.exception("verifying weights against %s failed", path)
            return {"ok": False, "mismatched": [f"verification failed: {error!r}"], "differing": []}

    def rl_load_weights(self, path: str) -> dict:
        """Reload weights in place from `path`, then verify them against the files.

        The files must hold exactly the served model's tensors with its shapes, checked before
        anything is loaded, so a wrong checkpoint is refused while the old weights keep serving.
        """
        reloaded = False
        try:
            start = time.perf_counter()
            files = self._rl_files(path)
            files_s = time.perf_counter() - start
            before = self._rl_compare(files)
            if before["mismatched"]:
                return before | {"ok": False, "reloaded": False}
            start, reloaded = time.perf_counter(), True
            self.reload_weights(weights_iterator=checkpoint_tensors(path, self._rl_dtype_tied()[1]))
            reload_s = time.perf_counter() - start
            return self._rl_compare(files) | {"reloaded": True, "reload_s": round(reload_s, 3), "files_s": round(files_s, 3)}
        except Exception as error:
            logger.exception("reloading weights from %s failed", path)
            return {"ok": False, "reloaded": reloaded, "mismatched": [f"reload failed: {error!r}"], "differing": []}

    def _rl_files(self, path: str) -> dict[str, Fingerprint]:
        return checkpoint_fingerprint(path, *self._rl_dtype_tied())

    def _rl_compare(self, files: dict[str, Fingerprint]) -> dict:
        start = time.perf_counter()
        report = compare(self._rl_served(), files, self._rl_dtype_tied()[0])
        return report | {"verify_s": round(time.perf_counter() - start, 3)}

    def _rl_served(self) -> dict[str, Fingerprint]:
        config = self.vllm_config
        if config.parallel_config.tensor_parallel_size != 1:
            raise NotImplementedError("weight verification supports tensor_parallel_size=1 only")
        with torch.inference_mode():
            model = self.model_runner.get_model()
            return served_fingerprint(model, config.model_config.dtype, config.model_config.get_vocab_size(), self.device)

    def _rl_dtype_tied(self) -> tuple[torch.dtype, bool]:
        model_config = self.vllm_config.model_config
        return model_config.dtype, bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
