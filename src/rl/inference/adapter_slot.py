"""The one LoRA adapter a LoRA server serves (InferenceConfig.lora): replaced in place at every step under one
name, in vLLM's slot `ADAPTER_ID`, and verified by reading the slot back on every worker (rl/inference/worker.py)."""

from __future__ import annotations

import time

from rl.inference.reload import prefix_cache_dropped
from rl.inference.reports import merge_reports
from rl.manifest import Entry

ADAPTER_ID = 1  # vLLM's lora_int_id of the one adapter a LoRA server serves, replaced in place at every step


class AdapterSlot:
    """`engine`: vLLM's engine client; `name`: the served adapter's name; `models`: vLLM's OpenAI model registry,
    where requests find the adapter by name."""

    def __init__(self, engine, name: str, models, reset_cache: bool = False):
        self.engine, self.name, self.models, self.reset_cache = engine, name, models, reset_cache

    async def load(self, path: str, step: int, manifest: dict[str, Entry]) -> dict:
        """Serve the adapter at `path`, the server's private copy of a step (rl.inference.staging), in place of the
        served adapter, under the one adapter name. Needs generation held (see `Reload.load`).

        a. each worker reads the copy's files once, checked against `manifest`, and refuses an adapter that does not
           fit the served LoRA layers (nothing is loaded then);
        b. vLLM's `add_lora` loads the copy itself, in place (`load_inplace`), into the adapter's slot on every
           worker (each its tensor-parallel part);
        c. each worker reads that slot back and compares it with the tensors it checked in a (vLLM's read is a
           second read of the copy: the comparison proves it got the same bytes).
        Once verified, requests find the adapter in vLLM's model registry, and vLLM labels what it samples with
        `step`. The report's checksum is `rl.adapter.adapter_checksum` of the files' tensors.
        """
        files = {name: [e.bytes, e.crc32] for name, e in manifest.items()}
        report = merge_reports(await self.engine.collective_rpc("rl_read_adapter", args=(path, files)))
        if not report["ok"]:
            return report
        async with prefix_cache_dropped(self.engine, self.reset_cache):  # else the gate salts requests per policy
            start = time.perf_counter()
            try:
                await self.engine.add_lora(self.request(path, load_inplace=True))
            except Exception as error:  # vLLM refused or failed to load it: the slot may hold anything now
                return report | {"ok": False, "reloaded": True, "mismatched": [f"vLLM's add_lora failed: {error}"]}
            reload_s = time.perf_counter() - start
            verified = merge_reports(await self.engine.collective_rpc("rl_verify_adapter", args=(ADAPTER_ID,)))
        report = report | verified | {"reloaded": True, "reload_s": round(reload_s, 3)}
        if report["ok"]:
            self.register(path)
            await self.engine.update_weight_version(str(step))
        return report

    def request(self, path: str, load_inplace: bool):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.name, lora_int_id=ADAPTER_ID, lora_path=path,
                           load_inplace=load_inplace)

    def register(self, path: str) -> None:
        """Let requests select the served adapter by name. The registry's request rides on every later generation
        request, so it must not ask for an in-place load: vLLM would reload the adapter from disk at every step."""
        if self.models is None:
            raise RuntimeError("this server has no OpenAI model registry to serve its adapter from")
        self.models.lora_requests[self.name] = self.request(path, load_inplace=False)

    async def remove(self) -> dict:
        """Serve the base model as step 0 again, after an adapter that failed to load when none was served before."""
        if self.models is not None:
            self.models.lora_requests.pop(self.name, None)
        try:
            await self.engine.remove_lora(ADAPTER_ID)
            still_loaded = ADAPTER_ID in await self.engine.list_loras()
        except Exception as error:
            return {"ok": False, "mismatched": [f"removing the adapter failed: {error}"], "differing": []}
        if still_loaded:
            return {"ok": False, "mismatched": ["vLLM still lists the adapter after removing it"], "differing": []}
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        await self.engine.update_weight_version("0")
        return {"ok": True, "mismatched": [], "differing": []}
