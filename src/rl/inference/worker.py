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
dense part agrees within rounding; `weights_checksum` then hashes every tensor of the files. What it proves:
every tensor of the files reaches the kernel that serves it, K columns of each matrix are served bit
for bit (so even a tiny training update that was not applied is caught), and W @ x agrees within
rounding along a random x (a stale or garbage head, row, column or shard is caught; a small change
confined to unsampled columns is not). Cost: one pass over the files plus a (K + 1)-row product per
matrix, in the server's process while the worker reloads (the reload reads the files once more);
then a (K + 1)-row product per served layer in the worker, after the reload.

With LoRA on (`--enable-lora`), vLLM wraps each layer it can adapt and keeps the original as `<name>.base_layer`:
the fingerprint reads the base layer under its checkpoint name, so the base model verifies as without LoRA.
Adapter steps are verified by reading back vLLM's LoRA slots (rl/inference/adapters.py): `rl_read_adapter`
before vLLM's own load, `rl_verify_adapter` after it.

Tied embeddings: vLLM's Qwen3 loader does not skip `lm_head.weight`, and its in-place reload leaves
the tied LM head's packed kernel stale when the files lack that tensor. `checkpoint_tensors` yields
`lm_head.weight` = `model.embed_tokens.weight` for a tied model whose files lack it, so a tied
checkpoint reloads correctly either way; the verification would catch it if it did not.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from rl.inference.adapters import AdapterMismatch, lora_slices, parse_adapter, slot_differences
from rl.inference.reading import ReadCount, read_adapter, read_step
from rl.manifest import CorruptFileError, Entry

logger = logging.getLogger(__name__)

PROBE_COLUMNS = 4
ROW_CHUNK = 8192  # rows of a matrix cast to float32 at a time, to bound the memory of a fingerprint
# Largest dense-probe error, relative to max_i sum_j |W_ij x_j|, that still counts as rounding.
DENSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
LORA_BASE = ".base_layer"  # where vLLM's LoRA wrapper keeps the layer it adapts


@dataclass
class Fingerprint:
    exact: torch.Tensor  # [K, out] sampled columns W[:, cols].T of a matrix, or a whole 1-D tensor
    dense: torch.Tensor | None  # [out] W @ x in float32, for a matrix
    shape: tuple[int, ...]  # of the tensor in checkpoint layout
    scale: float = 0.0  # max_i sum_j |W_ij x_j|: the size of the dense probe's terms (file side)


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
    """Fingerprint of a tensor as stored (a file tensor, or a parameter the model uses directly).

    Computed where `w` lives, in row chunks; only the small results are brought to the CPU.
    """
    w = w.detach()
    if w.ndim == 1:
        return Fingerprint(exact=w.to("cpu", dtype).clone(), dense=None, shape=tuple(w.shape))
    probes, magnitudes = _file_probes(w.shape[1], w.device)
    ys, scale = [], 0.0
    for rows in w.split(ROW_CHUNK):
        rows = rows.to(dtype).float()  # cast like the served copy, then compute in float32
        # x W^T as a linear layer computes it ([K + 1, rows]; on CPU much faster than W @ x^T for K + 1 rows).
        # One-hot rows give exact columns, as in the kernel's product.
        ys.append(torch.nn.functional.linear(probes, rows))
        scale = max(scale, torch.mv(rows.abs(), magnitudes).max().item())
    y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)).cpu()
    return Fingerprint(exact=y[:-1].to(dtype), dense=y[-1], shape=tuple(w.shape), scale=scale)


def kernel_fingerprint(y: torch.Tensor, dtype: torch.dtype, in_features: int) -> Fingerprint:
    """Fingerprint from a kernel's output on `probe_inputs`, y [K + 1, out]."""
    y = y.detach().to("cpu", dtype)
    return Fingerprint(exact=y[:-1].contiguous(), dense=y[-1].float(), shape=(y.shape[1], in_features))


def checkpoint_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def model_dir_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files of a model directory (the base model: the user's own files,
    under no STABLE marker), by name within each file."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                yield name, handle.get_tensor(name)


def with_tied_head(tensors: Iterator[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, plus the tied LM head (= the input embedding) if the files lack it."""
    names, embedding = set(), None
    for name, tensor in tensors:
        names.add(name)
        embedding = tensor if name == EMBEDDING else embedding
        yield name, tensor
    if tied and TIED_HEAD not in names and embedding is not None:
        yield TIED_HEAD, embedding


def checkpoint_tensors(path: str | Path, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files in `path`, plus the tied LM head if it is missing."""
    return with_tied_head(model_dir_tensors(path), tied)


def with_tied_shape(shapes: dict[str, tuple[int, ...]], tied: bool) -> dict[str, tuple[int, ...]]:
    if tied and TIED_HEAD not in shapes and EMBEDDING in shapes:
        shapes[TIED_HEAD] = shapes[EMBEDDING]
    return shapes


def checkpoint_shapes(path: str | Path, tied: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in `path`, from the files' headers alone (no tensor is read)."""
    shapes = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return with_tied_shape(shapes, tied)


def shape_mismatches(served: dict[str, tuple], files: dict[str, tuple]) -> list[str]:
    """What keeps `files` from being a checkpoint of the served model: missing, extra or reshaped tensors."""
    mismatched = [f"not served: {n}" for n in sorted(files.keys() - served.keys())]
    mismatched += [f"not in the files: {n}" for n in sorted(served.keys() - files.keys())]
    return mismatched + [f"{n}: served shape {served[n]}, files {files[n]}"
                         for n in sorted(files.keys() & served.keys()) if served[n] != files[n]]


class FileTally:
    """The fingerprint of every tensor of a checkpoint, cast to the served dtype, and `weights_checksum`: xxh3-128
    of every tensor's name, dtype, shape and bytes; both taken as the tensors pass on their way to the reload,
    so the files are read once. Once the served fingerprint matches, the checksum names what is served; it
    covers every element (the fingerprint samples a few columns exactly)."""

    def __init__(self, dtype: torch.dtype, device="cpu"):
        self.dtype, self.device = dtype, device
        self.prints: dict[str, Fingerprint] = {}
        self.digest = xxhash.xxh3_128()
        self.seconds = 0.0

    def through(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            start = time.perf_counter()
            self.digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
            self.digest.update(tensor.contiguous().view(torch.uint8).numpy())
            tensor = tensor.to(self.device)  # fingerprinted where it is served, and copied there once
            self.prints[name] = tensor_fingerprint(tensor, self.dtype)
            self.seconds += time.perf_counter() - start
            yield name, tensor

    @property
    def checksum(self) -> str:
        return self.digest.hexdigest()


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


def served_fingerprint(model: torch.nn.Module, dtype: torch.dtype, vocab_size: int, device) -> dict[str, Fingerprint]:
    """Fingerprint of what a vLLM model computes (tensor parallel size 1), by checkpoint name."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {})
    prints: dict[str, Fingerprint] = {}
    for prefix, module in model.named_modules():
        prefix = prefix.replace(LORA_BASE + ".", ".").removesuffix(LORA_BASE)  # a LoRA-wrapped layer's own name
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
    the traceback in this worker's log, so the server can roll back and answer with the reason. The worker
    reads the files itself, once: their fingerprint and checksum are taken as the tensors pass to the reload,
    then compared with the fingerprint of what it serves.
    """

    def rl_check_served(self, path: str) -> dict:
        """Verify what this worker serves against the model directory `path` (the base model, at start-up)."""
        dtype, tied = self._rl_dtype_tied()
        try:
            start = time.perf_counter()
            tally = FileTally(dtype, self.device)
            for _ in tally.through(checkpoint_tensors(path, tied)):
                pass
            return self._rl_verify(tally) | {"reloaded": False, "files_s": round(tally.seconds, 3),
                                              "verify_s": round(time.perf_counter() - start, 3)}
        except Exception as error:
            logger.exception("verifying the served weights against %s failed", path)
            return {"ok": False, "reloaded": False, "mismatched": [f"verification failed: {error!r}"], "differing": []}

    def rl_load_weights(self, path: str, files: dict[str, list] | None = None) -> dict:
        """Reload weights in place from `path` and verify them. `files` (name -> [bytes, crc32], the step's
        STABLE manifest) names the only files read, each once and checked as it is read; None reads a model
        directory's *.safetensors (the base model, on a rollback to step 0).

        A checkpoint that is not of the served model (a tensor missing, extra or of another shape, read
        from the files' headers), or a file that fails its check (`corrupt`), is refused before anything is
        loaded, so the old weights keep serving.
        """
        dtype, tied = self._rl_dtype_tied()
        count, reloaded = ReadCount(), False
        try:
            manifest = None if files is None else {name: Entry(*entry) for name, entry in files.items()}
            if manifest is None:
                shapes, source = checkpoint_shapes(path, tied), checkpoint_tensors(path, tied)
            else:
                step = read_step(Path(path), manifest, count)
                shapes, source = with_tied_shape(step.shapes(), tied), with_tied_head(step.tensors(), tied)
            mismatched = shape_mismatches(self._rl_shapes(), shapes)
            if mismatched:
                return {"ok": False, "reloaded": False, "mismatched": mismatched[:20], "differing": []}
            tally = FileTally(dtype, self.device)
            start, reloaded = time.perf_counter(), True
            self.reload_weights(weights_iterator=tally.through(source))
            reload_s = time.perf_counter() - start
        except CorruptFileError as error:  # found before the reload started
            return {"ok": False, "reloaded": reloaded, "corrupt": str(error), "mismatched": [str(error)], "differing": []}
        except Exception as error:
            logger.exception("reloading weights from %s failed", path)
            return {"ok": False, "reloaded": reloaded, "mismatched": [f"reload failed: {error!r}"], "differing": []}
        start = time.perf_counter()
        report = self._rl_verify(tally)
        return report | {"reloaded": True, "reload_s": round(reload_s, 3), "files_s": round(tally.seconds, 3),
                         "verify_s": round(time.perf_counter() - start, 3),
                         "bytes_read": count.data_bytes}

    def _rl_verify(self, tally: FileTally) -> dict:
        """Compare what is served with the files' fingerprint; the report carries the files' checksum."""
        report = compare(self._rl_served(), tally.prints, self._rl_dtype_tied()[0])
        return report | {"checksum": tally.checksum}

    def _rl_served(self) -> dict[str, Fingerprint]:
        config = self.vllm_config
        with torch.inference_mode():
            model = self.model_runner.get_model()
            prints = served_fingerprint(model, config.model_config.dtype, config.model_config.get_vocab_size(), self.device)
        self._rl_served_shapes = {name: p.shape for name, p in prints.items()}  # fixed: reloads are in place
        return prints

    def _rl_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every served tensor, from the first fingerprint of the served model."""
        if getattr(self, "_rl_served_shapes", None) is None:
            self._rl_served()
        return self._rl_served_shapes

    def _rl_dtype_tied(self) -> tuple[torch.dtype, bool]:
        model_config = self.vllm_config.model_config
        return model_config.dtype, bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))

    # ---- LoRA adapters (servers started with --enable-lora) ----

    def rl_read_adapter(self, path: str, files: dict[str, list]) -> dict:
        """Read an adapter step's files once (`files`: its STABLE manifest, name -> [bytes, crc32]; each file checked
        as it is read) and refuse, before vLLM loads anything, an adapter that does not fit the served LoRA layers.
        The checked tensors are kept for `rl_verify_adapter`."""
        self._rl_adapter = None
        count, start = ReadCount(), time.perf_counter()
        try:
            manifest = {name: Entry(*entry) for name, entry in files.items()}
            tensors, config = read_adapter(Path(path), manifest, count)
            manager = self._rl_lora_manager()
            adapter = parse_adapter(tensors, config, lora_slices(manager.modules, manager.packed_modules_mapping))
        except CorruptFileError as error:
            return {"ok": False, "reloaded": False, "corrupt": str(error), "mismatched": [str(error)], "differing": []}
        except AdapterMismatch as error:
            return {"ok": False, "reloaded": False, "mismatched": error.problems[:20], "differing": []}
        except Exception as error:
            logger.exception("reading the adapter at %s failed", path)
            return {"ok": False, "reloaded": False, "mismatched": [f"reading the adapter failed: {error!r}"],
                    "differing": []}
        self._rl_adapter = adapter
        return {"ok": True, "reloaded": False, "checksum": adapter.checksum, "bytes_read": count.data_bytes,
                "files_s": round(time.perf_counter() - start, 3)}

    def rl_verify_adapter(self, lora_id: int) -> dict:
        """Compare what vLLM activated for adapter `lora_id` with the tensors `rl_read_adapter` checked, in every LoRA
        layer's slot (rl/inference/adapters.py); the report carries the adapter's checksum."""
        adapter, self._rl_adapter = getattr(self, "_rl_adapter", None), None
        if adapter is None:
            return {"ok": False, "mismatched": ["no adapter was read before its verification"], "differing": []}
        start = time.perf_counter()
        try:
            manager = self._rl_lora_manager()
            if lora_id not in manager.lora_index_to_id:
                return {"ok": False, "mismatched": [f"adapter {lora_id} is active in no LoRA slot"], "differing": []}
            with torch.inference_mode():
                slices = lora_slices(manager.modules, manager.packed_modules_mapping)
                differing = slot_differences(manager.modules, slices, adapter, manager.lora_index_to_id.index(lora_id),
                                             self.vllm_config.model_config.dtype)
        except Exception as error:
            logger.exception("verifying adapter %d failed", lora_id)
            return {"ok": False, "mismatched": [f"verification failed: {error!r}"], "differing": []}
        return {"ok": not differing, "mismatched": [], "differing": differing[:20], "checksum": adapter.checksum,
                "verify_s": round(time.perf_counter() - start, 3)}

    def _rl_lora_manager(self):
        """vLLM's LoRA model manager: `modules` (its LoRA layers by module name), `packed_modules_mapping`
        (qkv_proj -> q/k/v_proj) and `lora_index_to_id` (slot -> adapter id)."""
        worker_manager = getattr(self.model_runner, "lora_manager", None)
        if worker_manager is None:
            raise RuntimeError("this server was started without LoRA: it has no LoRA layers")
        return worker_manager._adapter_manager
