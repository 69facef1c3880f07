"""The served policy: which step's weights this server serves, and every change to them. `PolicyWeights` takes an
update (a `step_<k>` directory the trainer published inside the weights dir) through resolution
(`rl.inference.step_dirs`), the checks of its STABLE marker and manifest, a hold on generation, the reload on every
vLLM worker and its verification, and rolls back, or refuses generation as broken, when a load fails. Which requests
may generate meanwhile is `rl.inference.admission`'s question; the reload and its verification
`rl.inference.reload`'s; a step over the wire is received by the engine's receiver (`rl.inference.wire`).

With LoRA on (InferenceConfig.lora: `--enable-lora --max-lora-rank R --max-loras 1`) a step is an adapter (its
manifest lists `adapter_config.json`), which replaces the served adapter in place under the one adapter name;
requests select it with `"model": <adapter name>` (the base model stays servable under its own name), and since
vLLM's own adapter routes stay refused, adapters change only here. Requests reach this state through
`rl.inference.gate`.
"""

import asyncio
import contextlib
import logging
import secrets
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import HTTPException

from rl.adapter import ADAPTER_CONFIG
from rl.inference import hooks
from rl.inference.adapter_slot import AdapterSlot
from rl.inference.admission import Admission
from rl.inference.reload import Reload
from rl.inference.reports import timings, why
from rl.inference.staging import PrivateCopies, StagedStep, release, stage_weights
from rl.inference.step_dirs import is_adapter_step, open_step_dir, published_step, resolve_step_dir
from rl.manifest import CorruptFileError, Entry, OpenDir
from rl.weights import RECEIVERS, StepRefused, TransferError
from rl.weights.offers import GroupSpec

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60  # the one-token generation that proves the served state clean after a failed load


@dataclass(frozen=True)
class AdminSettings:
    """What the admin routes need from `serve()`; carried to the app on vLLM's args namespace."""

    base_model: str
    weights_dir: str | None
    admin_token: str | None
    api_keys: tuple[str, ...] = ()  # vLLM's --api-key / VLLM_API_KEY: required on every generation route
    lora_name: str | None = None  # the served adapter's name (None: LoRA off, full-weight steps only)
    engine: str = "filesystem"  # inference.transfer's registered engine (rl/weights/): all but files take steps
    # over the wire too
    transfer_key: bytes | None = None  # what steps over the wire are sealed with (inference.transfer.secret's key)
    salt_per_policy: bool = True  # generation requests salted per policy (inference.prefix_cache_on_update)


class PolicyWeights:
    """Owns which policy step this server serves; every change goes through `update`, one at a time.

    Step 0 is the base model. A load that fails verification is rolled back to the previous step;
    if even that fails, the server refuses generation (`broken`) until a checkpoint verifies.
    A LoRA server (`settings.lora_name`) serves adapter steps only, over the base model; its step 0 may be the base
    model or step 0's adapter. `models` is vLLM's OpenAI model registry, where requests find the adapter by name.
    """

    def __init__(self, engine, settings: AdminSettings, models=None):
        self.engine, self.settings, self.models = engine, settings, models
        reset_cache = not settings.salt_per_policy
        self.slot = AdapterSlot(engine, settings.lora_name, models, reset_cache) if settings.lora_name else None
        self.step, self.path, self.checksum = 0, str(Path(settings.base_model).resolve()), None
        self.instance = secrets.token_hex(8)  # this server process's: one restarted answers with another
        self.marker: bytes | None = None  # the STABLE marker of the served step directory, as loaded
        self.manifest: dict[str, Entry] | None = None  # its files (None: the base model's directory)
        self.copies = PrivateCopies()  # adapter steps as checked, which vLLM loads (never the user's path)
        weakref.finalize(self, self.copies.close)  # removed when the server exits (a SIGKILL leaves them)
        self.adapter_copy: str | None = None  # the served adapter's private copy
        self.wire_staged: StagedStep | None = None  # the served step's bytes when it came over the wire (rollback)
        weakref.finalize(self, lambda s=self: s.wire_staged and s.wire_staged.close())
        self.broken: str | None = None
        self.lock = asyncio.Lock()
        receiver = RECEIVERS.load(settings.engine)  # None: steps come as files only
        self.receiver = receiver and receiver.create(engine, settings.transfer_key, settings.lora_name is not None,
                                                     self.generation_held, self._served_over_the_wire)
        self.admission = Admission(engine)  # the generation requests, held while the weights change
        self.reload = Reload(engine, settings.base_model, reset_cache)

    @property
    def in_flight(self) -> int:
        """Generation requests inside vLLM, counted by AdminMiddleware."""
        return self.admission.in_flight

    @in_flight.setter
    def in_flight(self, count: int) -> None:
        self.admission.in_flight = count

    async def current(self) -> dict:
        if self.checksum is None:
            async with self.lock:
                await self._verify_base()
        if self.broken:
            raise HTTPException(503, self.broken)
        served = {"step": self.step, "weights_checksum": self.checksum, "requests_in_flight": self.in_flight}
        return served | ({"adapter": self.adapter} if self.adapter else {})

    @property
    def cache_salt(self) -> str | None:
        """What generation requests are salted with (vLLM's `cache_salt`): one per served policy, so that a request
        never reuses KV another policy computed; None where the prefix cache is reset at each update instead."""
        return f"rl-policy-{self.step}" if self.settings.salt_per_policy else None

    @property
    def adapter(self) -> str | None:
        """The name of the adapter served, None while the base model is (or on a server without LoRA)."""
        return self.settings.lora_name if is_adapter_step(self.manifest) else None

    async def admit(self) -> str | None:
        """Wait while the weights change; None once a generation request may enter, else why it may not. The first
        requests wait for the base model's verification (once, as `current` does), which labels what vLLM samples
        as step 0: no token is sampled unlabelled ("default")."""
        if self.checksum is None:
            try:
                async with self.lock:
                    await self._verify_base()
            except HTTPException as e:
                return e.detail
        return await self.admission.wait() or self.broken

    async def update(self, step: int, path: str) -> dict:
        target = resolve_step_dir(self.settings.weights_dir, path, step)
        try:  # one handle from the check of the marker to the last read of the files: see rl.inference.staging
            directory = await asyncio.to_thread(open_step_dir, self.settings.weights_dir, target)
        except CorruptFileError as e:
            raise HTTPException(422, f"step {step} refused, {self._still_serving()}: {e}") from None
        try:
            return await self._update(step, target, directory)
        finally:
            directory.close()

    async def receive(self, step: int, spec: GroupSpec) -> dict:
        """Take step `step` over the wire (rl/weights/): received and checked against the trainer's checksum while
        generation goes on, then loaded and verified as a step read from files: full weights from the received
        bytes (kept for a rollback while served), an adapter from a private copy of them. A step that arrives altered
        is refused before anything is loaded."""
        if self.receiver is None:
            raise HTTPException(400, "this server takes weights from files only (inference.transfer.type is "
                                     "filesystem): send a `path`")
        if not self._may_serve_next(step):  # refused before the trainer's store is even reached
            raise HTTPException(409, f"step {step} is not newer than the served step {self.step}")
        start = time.perf_counter()
        try:
            received = await self.receiver.receive(spec, step)
        except StepRefused as e:
            logger.warning("step %d refused over the wire, %s: %s", step, self._still_serving(), e)
            raise HTTPException(e.status, f"step {step} refused, {self._still_serving()}: {e}") from None
        except CorruptFileError as e:
            logger.warning("step %d refused over the wire, %s: %s", step, self._still_serving(), e)
            raise HTTPException(422, f"step {step} refused, {self._still_serving()}: {e}") from None
        except TransferError as e:
            logger.warning("step %d did not arrive, %s: %s", step, self._still_serving(), e)
            raise HTTPException(504, f"step {step} did not arrive, {self._still_serving()}: {e}") from None
        try:
            staged, manifest = received.staged, None
            if received.adapter_config is not None:
                staged, manifest = await asyncio.to_thread(self.copies.write_adapter, received, step)
            async with self.lock:
                await self._verify_base()
                if not self._may_serve_next(step):  # another step was served meanwhile
                    raise HTTPException(409, f"step {step} is not newer than the served step {self.step}")
                marker = f"wire:{received.checksum}".encode()
                received_s = round(time.perf_counter() - start, 3)  # the transfer, the wait for the lock included
                reply = await self._held_switch(step, f"transfer:step_{step}", marker, manifest, staged)
                return reply | {"receive_s": received_s}
        finally:
            if received.staged is not self.wire_staged:
                await release(received.staged)
            if isinstance(staged, str) and staged != self.adapter_copy:
                self.copies.remove(staged)

    def _may_serve_next(self, step: int) -> bool:
        """Whether a step over the wire may replace the served one: a newer step, or any once the served weights
        are broken; on a LoRA server, step 0's adapter over the base model served as step 0 since start-up."""
        over_base = step == 0 and self.manifest is None and self.settings.lora_name is not None
        return step > self.step or over_base or self.broken is not None

    def _served_over_the_wire(self) -> StagedStep | None:
        """What a sparse step may change (rl/weights/): the full weights served, when they came over the wire
        and verified, through descriptors of their own (a step served meanwhile releases the server's)."""
        staged = self.wire_staged
        if staged is None or self.broken or staged.checksum != self.checksum:
            return None
        return staged.dup()

    async def _update(self, step: int, target: str, directory: OpenDir) -> dict:
        try:  # files truncated or changed since the trainer published them are never loaded
            marker, manifest = await asyncio.to_thread(published_step, directory)
        except CorruptFileError as e:
            raise HTTPException(422, f"step {step} refused, {self._still_serving()}: {e}") from None
        self._check_kind(step, target, manifest)
        await hooks.hold("after_check")
        async with self.lock:
            await self._verify_base()
            # step 0's adapter may replace the base model served as step 0 since start-up
            over_base = step == 0 and self.manifest is None and is_adapter_step(manifest)
            if step < self.step or (step == self.step and target != self.path and not over_base):
                raise HTTPException(409, f"step {step} is not newer than the served step {self.step}")
            if step == self.step and not self.broken and marker == self.marker:
                return {"step": self.step, "weights_checksum": self.checksum}  # a retried request, same files
            try:  # read and checked while generation goes on; nothing is loaded yet
                staged = await asyncio.to_thread(self._stage, directory, manifest)
            except CorruptFileError as e:
                raise HTTPException(422, f"step {step} refused, {self._still_serving()}: {e}") from None
            try:
                await hooks.hold("after_stage")
                return await self._held_switch(step, target, marker, manifest, staged)
            finally:
                if isinstance(staged, StagedStep):
                    await release(staged)
                elif staged != self.adapter_copy:
                    self.copies.remove(staged)

    async def _held_switch(self, step: int, target: str, marker: bytes, manifest: dict[str, Entry],
                           staged: StagedStep | str) -> dict:
        """Switch to the staged step with new generation requests held; needs the lock."""
        start, frozen = time.perf_counter(), 0
        try:
            async with self._held(prove_clean_on_failure=True) as frozen:
                return await self._switch(step, target, marker, manifest, staged) | {"paused_requests": frozen}
        finally:
            logger.info("update to step %d from %s in %.3f s (%d requests paused); %s step %d",
                        step, target, time.perf_counter() - start, frozen,
                        "BROKEN, generation refused; last verified" if self.broken else "serving", self.step)

    @contextlib.asynccontextmanager
    async def generation_held(self) -> AsyncIterator[None]:
        """Nothing generates inside (a transfer group forming); taken under the lock, so that no weight switch holds
        and releases generation meanwhile."""
        async with self.lock, self._held() as frozen:
            logger.info("generation held (%d requests frozen)", frozen)
            yield

    def _held(self, prove_clean_on_failure: bool = False) -> contextlib.AbstractAsyncContextManager[int]:
        """New generation requests wait in AdminMiddleware and those in flight are frozen (their number is yielded)
        until the block ends; a block that failed, with `prove_clean_on_failure`, has what is served proved clean
        before requests are admitted again. Needs the lock."""
        return self.admission.held(lambda: self.broken is not None,
                                   self._prove_clean_unless_broken if prove_clean_on_failure else None)

    async def _prove_clean_unless_broken(self) -> None:
        if not self.broken:
            await self._prove_clean()

    def _still_serving(self) -> str:
        if self.broken:
            return f"generation stays refused (broken since a failed load; last verified step {self.step})"
        return f"still serving step {self.step}"

    def _stage(self, directory: OpenDir, manifest: dict[str, Entry]) -> StagedStep | str:
        """The step's files as this server read and checked them, through `directory`: full weights staged in
        memory for the workers, an adapter copied to a private directory (its path)."""
        if is_adapter_step(manifest):
            return self.copies.stage_adapter(directory, manifest)
        return stage_weights(directory, manifest)

    async def _prove_clean(self) -> None:
        """After a failed load, prove that what is served computes finite logprobs (one token, the adapter's too
        when one is served); otherwise mark the weights broken and stop generation."""
        lora = self.slot.request(self.adapter_copy, load_inplace=False) if self.adapter else None
        try:
            finite = await asyncio.wait_for(self.reload.probe(lora), PROBE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure of the probe is a failure to prove
            finite, reason = False, f"the probe generation failed: {error!r}"
        else:
            reason = "a probe generation's logprobs are not finite"
        if not finite:
            self.broken = (f"after a failed load, step {self.step} no longer serves cleanly ({reason}); generation is "
                           "refused until a checkpoint loads and verifies")
            await self.admission.abort()

    def _check_kind(self, step: int, target: str, manifest: dict[str, Entry]) -> None:
        """400 unless the step is what this server loads: adapter steps with LoRA on, full weights without."""
        name = self.settings.lora_name
        if is_adapter_step(manifest) and name is None:
            raise HTTPException(400, f"step {step} at {target} is a LoRA adapter step (it lists {ADAPTER_CONFIG}), "
                                     "but this server was started without LoRA (inference.lora): it loads full weights")
        if not is_adapter_step(manifest) and name is not None:
            raise HTTPException(400, f"step {step} at {target} holds full weights (it lists no {ADAPTER_CONFIG}), but "
                                     f"this server serves the LoRA adapter {name!r} over a fixed base model: it loads "
                                     "adapter steps only")

    async def _switch(self, step: int, target: str, marker: bytes, manifest: dict[str, Entry],
                      staged: StagedStep | str) -> dict:
        """Load and verify the staged step while generation is held; needs the lock."""
        adapter = not isinstance(staged, StagedStep)
        report = await (self.slot.load(staged, step, manifest) if adapter else self.reload.load(staged, step))
        if not report["ok"]:
            raise await self._refuse(step, target, report)
        if adapter:
            self.copies.remove(self.adapter_copy)
            self.adapter_copy = staged
        await self._keep_for_rollback(staged if manifest is None else None)
        self.step, self.path, self.checksum, self.broken = step, target, report["checksum"], None
        self.marker, self.manifest = marker, manifest
        served = {"step": step, "weights_checksum": self.checksum} | ({"adapter": self.adapter} if self.adapter else {})
        return served | timings(report)

    async def _keep_for_rollback(self, wire_staged: StagedStep | None) -> None:
        """A step that came over the wire exists nowhere else: keep its bytes until another step is served."""
        before, self.wire_staged = self.wire_staged, wire_staged
        if before is not None and before is not wire_staged:
            await release(before)

    async def _verify_base(self) -> None:
        """Verify the weights loaded at start-up once, giving step 0 its checksum. Needs the lock."""
        if self.checksum is not None:
            return
        report = await self.reload.verify_base(self.path)
        if not report["ok"]:
            raise HTTPException(500, f"the base model's served weights do not match {self.path}: {why(report)}")
        self.checksum = report["checksum"]

    async def _refuse(self, step: int, target: str, report: dict) -> HTTPException:
        """Answer a failed load, rolling back to the served step when weights were touched. A file that failed
        its check when the worker read it is the caller's bad input (422), as when the server's own check finds it."""
        if not report["reloaded"]:
            if corrupt := report.get("corrupt"):
                return HTTPException(422, f"step {step} refused, {self._still_serving()}: {corrupt}")
            return HTTPException(400, f"step {step} at {target} does not fit the served model, "
                                      f"{self._still_serving()}: {why(report)}")
        failure = f"step {step} at {target} failed after reload: {why(report)}"
        rollback = await self._restore()
        if rollback["ok"]:
            served = (f" (adapter {self.adapter!r})" if self.adapter
                      else " (the base model)" if self.settings.lora_name else "")
            return HTTPException(500, f"{failure}; rolled back to step {self.step}{served}, which verifies")
        self.broken = (f"{failure}; rollback to step {self.step} failed too: {why(rollback)}; "
                       "generation is refused until a checkpoint loads and verifies")
        return HTTPException(500, self.broken)

    async def _restore(self) -> dict:
        """Serve again the step served before a failed load: the adapter from its private copy, full weights
        staged again from their directory (checked against the manifest they verified with), or from the bytes kept
        when they came over the wire."""
        if self.wire_staged is not None:
            return await self.reload.load(self.wire_staged, self.step)
        if is_adapter_step(self.manifest):
            return await self.slot.load(self.adapter_copy, self.step, self.manifest)
        if self.settings.lora_name is not None:  # no adapter was served yet: the base model, step 0
            return await self.slot.remove()
        if self.manifest is None:
            return await self.reload.load(None, self.step)
        try:
            with open_step_dir(self.settings.weights_dir, self.path) as directory:
                staged = await asyncio.to_thread(stage_weights, directory, self.manifest)
        except (CorruptFileError, OSError, ValueError) as error:
            return {"ok": False, "reloaded": False, "mismatched": [f"step {self.step}'s files: {error}"],
                    "differing": []}
        try:
            return await self.reload.load(staged, self.step)
        finally:
            await release(staged)
