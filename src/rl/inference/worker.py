"""vLLM worker extension: reload weights in place from a step directory, and prove what is served.

Loaded into every vLLM worker with `--worker-extension-cls rl.inference.worker.WeightSyncExtension`;
the server calls its methods with `engine_client.collective_rpc("rl_load_weights", args=(path,))`. Full weights
are verified by their fingerprint (rl/inference/fingerprint.py says what it proves); adapter steps by reading back
vLLM's LoRA slots (rl/inference/adapters.py): `rl_read_adapter` before vLLM's own load, `rl_verify_adapter` after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rl.inference.adapters import AdapterMismatch, lora_slices, parse_adapter, slot_differences
from rl.inference.fingerprint import FileTally, Fingerprint, compare, served_fingerprint, shape_mismatches
from rl.inference.reading import (
    MappedStep, ReadCount, checkpoint_shapes, checkpoint_tensors, read_adapter, with_tied_head, with_tied_shape,
)
from rl.inference.layout import ServedLayout
from rl.inference.staging import receive_weights
from rl.manifest import CorruptFileError, Entry
from rl.weights import StepRefused, TransferError
from rl.weights.group import Deadline, GroupKeeper
from rl.weights.offers import GroupSpec
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
            tally = FileTally(dtype, self.device, self._rl_shards())
            for _ in tally.through(checkpoint_tensors(path, tied)):
                pass
            return self._rl_verify(tally) | {"reloaded": False, "files_s": round(tally.seconds, 3),
                                              "verify_s": round(time.perf_counter() - start, 3)}
        except Exception as error:
            logger.exception("verifying the served weights against %s failed", path)
            return {"ok": False, "reloaded": False, "mismatched": [f"verification failed: {error!r}"], "differing": []}

    def rl_load_weights(self, staged: dict | None = None, path: str | None = None, faults: dict | None = None
                        ) -> dict:
        """Reload weights in place and verify them: from the step files the server staged (`staged`:
        `StagedStep.rpc()`, checked and hashed as the server read them) or, with `staged` None, from the model
        directory `path` (the base model, on a rollback to step 0). `faults` (tests only: rl.inference.hooks) fail or
        corrupt the reload on purpose, to prove the verification and the rollback.

        A checkpoint that is not of the served model (a tensor missing, extra or of another shape, read from the
        files' headers) is refused before anything is loaded, so the old weights keep serving.
        """
        dtype, tied = self._rl_dtype_tied()
        reloaded = False
        try:
            if staged is None:
                shapes, source = checkpoint_shapes(path, tied), checkpoint_tensors(path, tied)
            else:
                step = MappedStep(staged)
                shapes, source = with_tied_shape(step.shapes(), tied), with_tied_head(step.tensors(), tied)
            mismatched = shape_mismatches(self._rl_shapes(), shapes)
            if mismatched:
                return {"ok": False, "reloaded": False, "mismatched": mismatched[:20], "differing": []}
            tally = FileTally(dtype, self.device, self._rl_shards(), None if staged is None else staged["checksum"])
            start, reloaded = time.perf_counter(), True
            self._rl_reload(_with_faults(tally.through(source), faults or {}, self._rl_tp_rank()))
            reload_s = time.perf_counter() - start
        except CorruptFileError as error:  # found before the reload started
            return {"ok": False, "reloaded": reloaded, "corrupt": str(error), "mismatched": [str(error)],
                    "differing": []}
        except Exception as error:
            logger.exception("reloading weights (%s) failed", path or "staged step")
            return {"ok": False, "reloaded": reloaded, "mismatched": [f"reload failed: {error!r}"], "differing": []}
        start = time.perf_counter()
        report = self._rl_verify(tally)
        return report | {"reloaded": True, "reload_s": round(reload_s, 3), "files_s": round(tally.seconds, 3),
                         "verify_s": round(time.perf_counter() - start, 3), "device_bytes": tally.device_bytes}

    def _rl_reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload. vLLM moves each layer to the meta device as the reload begins and processes it
        once all its tensors arrived; a reload that stops halfway (an error in the source) would leave the layers
        it had not finished in that state, and the rollback's reload would then fail on them ('Parameter' object
        has no attribute 'weight_loader'). So a failed reload is finalized as vLLM finalizes a complete one: layers
        never reached get their old tensors back, and the rollback reloads every layer from whole files."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            self.reload_weights(weights_iterator=weights)
        except BaseException:
            try:
                finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
            except Exception:
                logger.exception("finalizing the failed reload failed too")
            raise

    def _rl_verify(self, tally: FileTally) -> dict:
        """Compare what is served with the files' fingerprint; the report carries the files' checksum."""
        report = compare(self._rl_served(), tally.prints, self._rl_dtype_tied()[0])
        return report | {"checksum": tally.checksum, "tp_rank": self._rl_tp_rank()}

    def _rl_served(self) -> dict[str, Fingerprint]:
        with torch.inference_mode():
            model = self.model_runner.get_model()
            prints = served_fingerprint(model, self.vllm_config.model_config.dtype, self.device)
        # fixed: reloads are in place
        self._rl_served_layout = {name: (p.shape, p.shard) for name, p in prints.items()}
        return prints

    def _rl_layout(self) -> dict:
        """Checkpoint name -> (whole shape, the shard served here) of every served tensor, from the first
        fingerprint of the served model."""
        if getattr(self, "_rl_served_layout", None) is None:
            self._rl_served()
        return self._rl_served_layout

    def _rl_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._rl_layout().items()}

    def _rl_shards(self) -> dict:
        return {name: shard for name, (_, shard) in self._rl_layout().items() if shard is not None}

    def _rl_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def _rl_dtype_tied(self) -> tuple[torch.dtype, bool]:
        model_config = self.vllm_config.model_config
        return model_config.dtype, bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))

    # ---- a step over NCCL (rl/weights/): the first worker receives it for its server ----

    def rl_served_layout(self) -> dict | None:
        """On the first tensor-parallel worker: the served dtype, whether the head is tied, and every served tensor's
        whole shape by checkpoint name (what a step over the wire must match: rl.inference.layout)."""
        if self._rl_tp_rank() != 0:
            return None
        dtype, tied = self._rl_dtype_tied()
        return {"dtype": str(dtype).removeprefix("torch."), "shapes": self._rl_shapes(), "tied": tied}

    def rl_receive_weights(self, spec: dict, step: int, backend: str, key: bytes, layout: dict,
                           base: dict | None = None) -> dict | None:
        """On the first tensor-parallel worker (the others answer None): start receiving step `step` in a thread of
        this worker, which joins the step's group at the server's rank with this worker's GPU and receives the step
        into a sealed memfd checked against the trainer's checksum (`rl.inference.staging.receive_weights`), while
        the worker goes on generating: on a CUDA stream of its own, so that neither its copies nor NCCL's wait for
        them queue behind vLLM's work on the default stream. A group that must form (the first step, or after a
        failure) forms with generation held: the thread asks for it (`rl_received` says `hold`) and waits for
        `rl_generation_held`. `base` (sparse transports): the weights served, as the server staged them.
        `rl_received` tells how it went."""
        if self._rl_tp_rank() != 0:
            return None
        thread, _ = getattr(self, "_rl_receiving", (None, {}))
        if thread is not None and thread.is_alive():
            return {"error": f"{thread.name} is still in progress", "kind": "transfer"}
        self.rl_release_received()
        outcome: dict = {}
        device = torch.cuda.current_device() if backend == "nccl" else None
        if getattr(self, "_rl_transfer_group", None) is None:
            self._rl_transfer_group = GroupKeeper()  # this worker's group with the trainer, kept between steps
        self._rl_held = threading.Event()

        @contextlib.contextmanager
        def generation_held(deadline: Deadline) -> Iterator[None]:
            outcome["hold"] = True
            try:
                if not self._rl_held.wait(deadline.left(f"the server held generation for step {step}'s group")):
                    raise TransferError(f"the server did not hold generation for step {step}'s transfer group to "
                                        f"form within the step's {deadline.seconds:g} s")
                yield
            finally:
                outcome.pop("hold", None)

        def receive() -> None:
            stream = None
            if device is not None:
                torch.cuda.set_device(device)  # a new thread starts on GPU 0
                stream = torch.cuda.Stream(device)
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    outcome["received"] = receive_weights(GroupSpec(**spec), step, key, backend,
                                                          self._rl_transfer_group, base, ServedLayout.from_rpc(layout),
                                                          generation_held)
            except CorruptFileError as error:
                outcome["error"] = {"error": str(error), "kind": "corrupt"}
            except StepRefused as error:
                outcome["error"] = {"error": str(error), "kind": "refused", "status": error.status}
            except TransferError as error:
                outcome["error"] = {"error": str(error), "kind": "transfer"}
            except Exception as error:  # noqa: BLE001 - reported to the server, with the traceback in this log
                logger.exception("receiving step %d failed", step)
                outcome["error"] = {"error": f"receiving failed: {error!r}", "kind": "transfer"}

        thread = threading.Thread(target=receive, name=f"the receive of step {step}", daemon=True)
        self._rl_receiving = (thread, outcome)
        thread.start()
        return {"started": step}

    def rl_received(self) -> dict | None:
        """How the receive `rl_receive_weights` started went: `pending`; or the step, kept open until the server took
        it over (`pid` and `fd` name it; `rl_release_received`); or `error` and its `kind`: `corrupt` (it arrived
        altered) or `transfer` (it did not arrive). None on the other workers."""
        if self._rl_tp_rank() != 0:
            return None
        thread, outcome = getattr(self, "_rl_receiving", (None, {}))
        if thread is None:
            return {"error": "no receive was started", "kind": "transfer"}
        if thread.is_alive():
            return {"pending": True, "hold": outcome.get("hold", False)}
        self._rl_receiving = (None, {})
        if "error" in outcome:
            return outcome["error"]
        received = outcome["received"]
        self._rl_received = received.staged
        fd, size = next(iter(received.staged.files.values()))
        return {"pid": os.getpid(), "fd": fd, "size": size, "checksum": received.checksum,
                "adapter_config": received.adapter_config}

    def rl_generation_held(self) -> None:
        """The server holds generation: the group the receive asked to form it for may form now."""
        if self._rl_tp_rank() == 0:
            self._rl_held.set()

    def rl_release_received(self) -> None:
        """Close this worker's descriptor of the last step it received (the server holds its own)."""
        staged, self._rl_received = getattr(self, "_rl_received", None), None
        if staged is not None:
            staged.close()

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


def _with_faults(tensors: Iterator, faults: dict, tp_rank: int) -> Iterator:
    """`tensors` with the test hooks' faults (rl.inference.hooks): failing at tensor `fail_at`, or one row of
    one tensor changed on worker `rank` after its fingerprint was taken (`corrupt`: [name, row, rank])."""
    corrupt_name, row, rank = faults.get("corrupt") or (None, 0, 0)
    for i, (name, tensor) in enumerate(tensors):
        if i == faults.get("fail_at"):
            raise RuntimeError(f"reload failed on purpose at tensor {i} (test hook)")
        if name == corrupt_name and rank == tp_rank:  # in place: a tied head fed later from these bytes gets it too
            tensor[row] += 1
        yield name, tensor
