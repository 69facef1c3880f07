"""vLLM worker extension: reload weights in place from a step directory, and prove what is served.

Loaded into every vLLM worker with `--worker-extension-cls rl.inference.worker.WeightSyncExtension`;
the server calls its methods with `engine_client.collective_rpc("rl_load_weights", args=(path,))`. Full weights
are verified by their fingerprint (rl/inference/fingerprint.py says what it proves); adapter steps by reading back
vLLM's LoRA slots (rl/inference/adapters.py): `rl_read_adapter` before vLLM's own load, `rl_verify_adapter` after it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from rl.inference.adapters import AdapterMismatch, lora_slices, parse_adapter, slot_differences
from rl.inference.fingerprint import FileTally, Fingerprint, compare, served_fingerprint, shape_mismatches
from rl.inference.reading import (
    ReadCount, checkpoint_shapes, checkpoint_tensors, read_adapter, read_step, with_tied_head, with_tied_shape,
)
from rl.manifest import CorruptFileError, Entry

logger = logging.getLogger(__name__)


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
            return {"ok": False, "reloaded": reloaded, "corrupt": str(error), "mismatched": [str(error)],
                    "differing": []}
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
            prints = served_fingerprint(
                model, config.model_config.dtype, config.model_config.get_vocab_size(), self.device
            )
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
