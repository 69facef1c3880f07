"""The inference server: vLLM's own OpenAI-compatible server plus the admin routes `rl` needs.

`serve()` builds vLLM's argument parser and runs vLLM's `run_server`, adding through vLLM's public
hooks only:

- `--worker-extension-cls rl.inference.worker.WeightSyncExtension`: in-place reload and the
  fingerprint of the served weights, reached with `engine_client.collective_rpc` (the files'
  fingerprint is computed here, in the server's process, while the worker reloads);
- `--middleware rl.inference.server.AdminMiddleware`: an ASGI middleware that answers
  `POST /update_weights` and `GET /policy_step`, refuses every route off its allow-list (judged after
  vLLM's `--root-path` is stripped), holds generation requests during an update, and
  rewrites the logprobs of `/inference/v1/generate` into the shape verifiers' training client reads;
- `--enable-scale-out` (vLLM serves `/inference/v1/generate` only with it) and
  `--logprobs-mode processed_logprobs` (logprobs of the distribution actually sampled from, which
  importance ratios at temperature != 1 need).

On CPU hosts it also sets `RL_VLLM_SHM_POLL_S`, which our vLLM plugin (`rl/patches.py`) reads
in each vLLM process: vLLM's inter-process queues then sleep between polls instead of spinning.

    python -m rl.inference.main @ infer.toml --port 8000     (the entrypoint; see inference/main.py)

With `lora` (InferenceConfig.lora) it serves one LoRA adapter over a fixed base model (`--enable-lora
--max-lora-rank R --max-loras 1`): an update names an adapter step (its manifest lists `adapter_config.json`), which
replaces the served adapter in place under the one adapter name (`PolicyWeights._load_adapter`); requests select it
with `"model": <adapter name>` (the base model stays servable under its own name). vLLM's own
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` stay refused: adapters change only through /update_weights.

Admin routes (JSON; errors are `{"detail": "..."}` with a 4xx status, or 500 when a reload failed):

    POST /update_weights {"step": k, "path": "step_k"}  -> {"step": k, "weights_checksum": "...", ...}
    GET  /policy_step                    -> {"step": k, "weights_checksum": "...", "requests_in_flight": n}
    (both with "adapter": <name> while an adapter is served; its weights_checksum is rl.adapter.adapter_checksum)

They need `Authorization: Bearer <admin_token>` when a token is set, and answer only loopback
clients when none is.
"""

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl import patches
from rl.adapter import ADAPTER_CONFIG
from rl.inference.config import LoraServingConfig
from rl.manifest import STABLE, CorruptFileError, Entry, check_listed, read_manifest, read_marker

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "rl.inference.worker.WeightSyncExtension"
MIDDLEWARE = "rl.inference.server.AdminMiddleware"
ADMIN_PATHS = {"/update_weights", "/policy_step"}
GENERATE_PATH = "/inference/v1/generate"
# Routes by allow-list: a route not named here is refused (403), whatever vLLM serves now or adds later (its
# control and development routes change what is served, or how, without verification).
# Open: answer without running the model, so no API key, no hold.
OPEN_PATHS = {"/health", "/ping", "/version", "/metrics", "/load", "/v1/models"}
# Generation: what rl's clients call (verifiers' training client, the in-process harness) and documents;
# authenticated with the API key if one is set, held while the weights change, counted in flight, refused
# while broken.
GENERATION_PATHS = {GENERATE_PATH, "/v1/chat/completions", "/v1/completions"}
# A route in plain form: segments of letters, digits, `_`, `-`, `.` (no empty, `.` or `..` segment, no
# percent-encoding, no trailing slash). Any other spelling is refused rather than normalised, so what the
# rules check is exactly what vLLM's router matches.
PLAIN_ROUTE = re.compile(r"(?:/(?!\.\.?(?:/|$))[A-Za-z0-9_.\-]+)+")
MAX_JSON_DEPTH = 8  # an update request is one flat object
# A JSON string (one left open runs to the end: every match is linear) or any character but a bracket.
JSON_STRING_OR_NOT_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[^\[\]{}]', re.DOTALL)
MAX_INT_DIGITS = 100  # an int64 has 19
NAME_MAX = 255  # bytes in one path component (Linux)
PATH_MAX = 4096  # bytes in a path (Linux)
MAX_ADMIN_BODY = 64 * 1024  # an update request is ~100 bytes
MAX_STEP = 2**63 - 1  # policy versions travel as int64
ADMIT_TIMEOUT_S = 900  # longest a generation request waits for a weight update (a large model's reload)
# On SIGTERM vLLM stops its engine first, so a request still open cannot finish (an update awaiting the
# engine's reply would wait forever), and uvicorn by default waits for every open request.
SHUTDOWN_GRACE_S = 5
# Idle keep-alive on the server side; longer than clients' (httpx: 5 s, the orchestrator's aiohttp: 15 s).
KEEP_ALIVE_S = 75
SOCKET_PATH_MAX = 107  # a unix socket's path in bytes (sockaddr_un.sun_path, less its NUL)
UUID_CHARS = 36  # vLLM names each socket by a uuid4
ADAPTER_ID = 1  # vLLM's lora_int_id of the one adapter a LoRA server serves, replaced in place at every step


@dataclass(frozen=True)
class AdminSettings:
    """What the admin routes need from `serve()`; carried to the app on vLLM's args namespace."""

    base_model: str
    weights_dir: str | None
    admin_token: str | None
    api_keys: tuple[str, ...] = ()  # vLLM's --api-key / VLLM_API_KEY: required on every generation route
    lora_name: str | None = None  # the served adapter's name (None: LoRA off, full-weight steps only)
    lora_max_rank: int | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: Annotated[StrictInt, Field(ge=0, le=MAX_STEP, description="policy version the weights hold")]
    path: Annotated[
        str, Field(min_length=1, max_length=PATH_MAX, pattern=r"^[^\x00]*$",
                   description="the step's step_<step> directory, inside the weights dir")
    ]

    @field_validator("path")
    @classmethod
    def _fits_the_filesystem(cls, path: str) -> str:
        """A path the OS can take: UTF-8 (no lone surrogate), components of at most NAME_MAX bytes."""
        try:
            encoded = path.encode()
        except UnicodeEncodeError:
            raise ValueError("holds a lone surrogate: not UTF-8") from None
        if len(encoded) > PATH_MAX:
            raise ValueError(f"is over {PATH_MAX} bytes")
        if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
            raise ValueError(f"has a component over {NAME_MAX} bytes")
        return path


class PolicyWeights:
    """Owns which policy step this server serves; every change goes through `update`, one at a time.

    Step 0 is the base model. A load that fails verification is rolled back to the previous step;
    if even that fails, the server refuses generation (`broken`) until a checkpoint verifies.
    A LoRA server (`settings.lora_name`) serves adapter steps only, over the base model; its step 0 may be the base
    model or step 0's adapter. `models` is vLLM's OpenAI model registry, where requests find the adapter by name.
    """

    def __init__(self, engine, settings: AdminSettings, models=None):
        self.engine, self.settings, self.models = engine, settings, models
        self.step, self.path, self.checksum = 0, str(Path(settings.base_model).resolve()), None
        self.marker: bytes | None = None  # the STABLE marker of the served step directory, as loaded
        self.manifest: dict[str, Entry] | None = None  # its files (None: the base model's directory)
        self.broken: str | None = None
        self.lock = asyncio.Lock()
        # Generation requests inside vLLM, counted by AdminMiddleware; new ones wait at `admitting`
        # while the weights change, so only requests already in flight need vLLM to pause.
        self.in_flight = 0
        self.admitting = asyncio.Event()
        self.admitting.set()
        self.engine_paused = False

    async def current(self) -> dict:
        if self.checksum is None:
            async with self.lock:
                await self._verify_base()
        if self.broken:
            raise HTTPException(503, self.broken)
        served = {"step": self.step, "weights_checksum": self.checksum, "requests_in_flight": self.in_flight}
        return served | ({"adapter": self.adapter} if self.adapter else {})

    @property
    def adapter(self) -> str | None:
        """The name of the adapter served, None while the base model is (or on a server without LoRA)."""
        return self.settings.lora_name if is_adapter_step(self.manifest) else None

    async def admit(self) -> str | None:
        """Wait while the weights change; None once a generation request may enter, else why it may not."""
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        while not self.admitting.is_set():  # re-checked on waking: another update may have begun since
            try:
                await asyncio.wait_for(self.admitting.wait(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                return f"waited {ADMIT_TIMEOUT_S} s for a weight update to finish"
        return self.broken

    async def update(self, step: int, path: str) -> dict:
        target = self._resolve(path, step)
        try:  # files truncated or changed since the trainer published them are never loaded
            marker, manifest = await asyncio.to_thread(published_step, Path(target))
        except CorruptFileError as e:
            raise HTTPException(422, f"step {step} refused, still serving step {self.step}: {e}") from None
        self._check_kind(step, target, manifest)
        async with self.lock:
            await self._verify_base()
            # step 0's adapter may replace the base model served as step 0 since start-up
            over_base = step == 0 and self.manifest is None and is_adapter_step(manifest)
            if step < self.step or (step == self.step and target != self.path and not over_base):
                raise HTTPException(409, f"step {step} is not newer than the served step {self.step}")
            if step == self.step and not self.broken and marker == self.marker:
                return {"step": self.step, "weights_checksum": self.checksum}  # a retried request, same files
            start, frozen = time.perf_counter(), 0
            self.admitting.clear()  # new generation requests wait in AdminMiddleware until the switch is done
            try:
                frozen = await self._freeze_in_flight()
                return await self._switch(step, target, marker, manifest) | {"paused_requests": frozen}
            finally:
                try:
                    await self._release()
                finally:
                    self.admitting.set()
                logger.info("update to step %d from %s in %.3f s (%d requests paused); %s step %d",
                            step, target, time.perf_counter() - start, frozen,
                            "BROKEN, generation refused; last verified" if self.broken else "serving", self.step)

    async def _freeze_in_flight(self) -> int:
        """Freeze the requests vLLM is running, so that no token is sampled between the reload and the new
        weight version (vLLM labels each output token with the version that sampled it). New requests
        wait at `admitting`, so with none in flight there is nothing to pause."""
        frozen = self.in_flight
        if frozen and not self.engine_paused:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            self.engine_paused = True
        return frozen

    async def _release(self) -> None:
        """Resume what was frozen; if the weights are broken, abort it and keep vLLM paused instead."""
        if self.broken:
            await self.engine.pause_generation(mode="abort", clear_cache=False)
            self.engine_paused = True
        elif self.engine_paused:
            await self.engine.resume_generation()
            self.engine_paused = False

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

    async def _switch(self, step: int, target: str, marker: bytes, manifest: dict[str, Entry]) -> dict:
        """Load and verify `target` while generation is held; needs the lock."""
        load = self._load_adapter if is_adapter_step(manifest) else self._load
        report = await load(target, step, manifest)
        if not report["ok"]:
            raise await self._refuse(step, target, report)
        self.step, self.path, self.checksum, self.broken = step, target, report["checksum"], None
        self.marker, self.manifest = marker, manifest
        served = {"step": step, "weights_checksum": self.checksum} | ({"adapter": self.adapter} if self.adapter else {})
        return served | _timings(report)

    def _resolve(self, path: str, step: int) -> str:
        """The real path of the step's own `step_<step>` directory, strictly inside the weights dir, with a
        STABLE marker and no file that leads outside the weights dir."""
        if self.settings.weights_dir is None:
            raise HTTPException(403, "this server was started without a weights dir: updates are off")
        try:
            return self._resolve_in(Path(os.path.realpath(self.settings.weights_dir)), path, step)
        except OSError as e:  # e.g. the weights dir and the path together past the OS's path limit
            raise HTTPException(400, f"{path[:200]!a} cannot be resolved: {e.strerror}") from None

    def _resolve_in(self, root: Path, path: str, step: int) -> str:
        target = Path(os.path.realpath(root / path))
        if target == root or not target.is_relative_to(root):
            raise HTTPException(403, f"{path!r} resolves to {target}, outside the weights dir {root}")
        if not target.is_dir():
            raise HTTPException(404, f"no step directory at {target}")
        if target.name != f"step_{step}":
            raise HTTPException(400, f"{path!r} is {target.name}: step {step} loads only from step_{step}")
        if not (target / STABLE).exists():
            raise HTTPException(409, f"{target} has no {STABLE} marker yet: it may be half written")
        for entry in target.rglob("*"):
            if entry.is_symlink() and not Path(os.path.realpath(entry)).is_relative_to(root):
                raise HTTPException(403, f"{entry} links to {os.path.realpath(entry)}, outside the weights dir {root}")
        return str(target)

    async def _verify_base(self) -> None:
        """Verify the weights loaded at start-up once, giving step 0 its checksum. Needs the lock."""
        if self.checksum is not None:
            return
        report = _merge(await self.engine.collective_rpc("rl_check_served", args=(self.path,)))
        if not report["ok"]:
            raise HTTPException(500, f"the base model's served weights do not match {self.path}: {_why(report)}")
        self.checksum = report["checksum"]
        await self.engine.update_weight_version("0")

    async def _load(self, path: str, step: int, manifest: dict[str, Entry] | None) -> dict:
        """Reload `path` on every worker, which reads its listed weight files once (`manifest`; None: the base
        model's directory) and verifies what it then serves; once verified, vLLM labels what it samples with `step`.

        Needs generation held (no KV is computed until `_release`), so the prefix cache can be dropped
        while the worker reloads: running requests are preempted and their prompts and tokens so far
        recomputed with the new weights when generation resumes.
        """
        files = None if manifest is None else {name: [e.bytes, e.crc32] for name, e in manifest.items()}
        reset = asyncio.create_task(self.engine.reset_prefix_cache(reset_running_requests=True))
        report = _merge(await self.engine.collective_rpc("rl_load_weights", args=(path, files)))
        await reset
        if report["ok"]:
            await self.engine.update_weight_version(str(step))
        return report

    async def _refuse(self, step: int, target: str, report: dict) -> HTTPException:
        """Answer a failed load, rolling back to the served step when weights were touched. A file that failed
        its check when the worker read it is the caller's bad input (422), as when the server's own check finds it."""
        if not report["reloaded"]:
            if corrupt := report.get("corrupt"):
                return HTTPException(422, f"step {step} refused, still serving step {self.step}: {corrupt}")
            return HTTPException(400, f"step {step} at {target} does not fit the served model, "
                                      f"still serving step {self.step}: {_why(report)}")
        failure = f"step {step} at {target} failed after reload: {_why(report)}"
        rollback = await self._restore()
        if rollback["ok"]:
            served = (f" (adapter {self.adapter!r})" if self.adapter
                      else " (the base model)" if self.settings.lora_name else "")
            return HTTPException(500, f"{failure}; rolled back to step {self.step}{served}, which verifies")
        self.broken = (f"{failure}; rollback to step {self.step} failed too: {_why(rollback)}; "
                       "generation is refused until a checkpoint loads and verifies")
        return HTTPException(500, self.broken)

    async def _restore(self) -> dict:
        """Serve again the step served before a failed load, loaded as it was the first time."""
        if is_adapter_step(self.manifest):
            return await self._load_adapter(self.path, self.step, self.manifest)
        if self.settings.lora_name is not None:  # no adapter was served yet: the base model, step 0
            return await self._remove_adapter()
        return await self._load(self.path, self.step, self.manifest)

    async def _load_adapter(self, path: str, step: int, manifest: dict[str, Entry]) -> dict:
        """Serve the adapter step at `path` in place of the served adapter, under the one adapter name. Needs
        generation held (see `_load`).

        a. each worker reads the step's files once, checked against `manifest`, and refuses an adapter that does not
           fit the served LoRA layers (nothing is loaded then);
        b. vLLM's `add_lora` loads the directory itself, in place (`load_inplace`), into the adapter's slot;
        c. each worker reads that slot back and compares it with the tensors it checked in a (vLLM's read is a
           second read of the files: the comparison proves it got the same bytes).
        Once verified, requests find the adapter in vLLM's model registry, and vLLM labels what it samples with
        `step`. The report's checksum is `rl.adapter.adapter_checksum` of the files' tensors.
        """
        files = {name: [e.bytes, e.crc32] for name, e in manifest.items()}
        report = _merge(await self.engine.collective_rpc("rl_read_adapter", args=(path, files)))
        if not report["ok"]:
            return report
        reset = asyncio.create_task(self.engine.reset_prefix_cache(reset_running_requests=True))
        try:
            start = time.perf_counter()
            try:
                await self.engine.add_lora(self._lora_request(path, load_inplace=True))
            except Exception as error:  # vLLM refused or failed to load it: the slot may hold anything now
                return report | {"ok": False, "reloaded": True, "mismatched": [f"vLLM's add_lora failed: {error}"]}
            reload_s = time.perf_counter() - start
            verified = _merge(await self.engine.collective_rpc("rl_verify_adapter", args=(ADAPTER_ID,)))
        finally:
            await reset
        report = report | verified | {"reloaded": True, "reload_s": round(reload_s, 3)}
        if report["ok"]:
            self._register_adapter(path)
            await self.engine.update_weight_version(str(step))
        return report

    def _lora_request(self, path: str, load_inplace: bool):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.settings.lora_name, lora_int_id=ADAPTER_ID, lora_path=path,
                           load_inplace=load_inplace)

    def _register_adapter(self, path: str) -> None:
        """Let requests select the served adapter by name. The registry's request rides on every later generation
        request, so it must not ask for an in-place load: vLLM would reload the adapter from disk at every step."""
        if self.models is None:
            raise RuntimeError("this server has no OpenAI model registry to serve its adapter from")
        self.models.lora_requests[self.settings.lora_name] = self._lora_request(path, load_inplace=False)

    async def _remove_adapter(self) -> dict:
        """Serve the base model as step 0 again, after an adapter that failed to load when none was served before."""
        if self.models is not None:
            self.models.lora_requests.pop(self.settings.lora_name, None)
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


def is_adapter_step(manifest: dict[str, Entry] | None) -> bool:
    """Whether a step's files are a LoRA adapter (rl.adapter's layout) rather than full weights."""
    return manifest is not None and ADAPTER_CONFIG in manifest


def published_step(directory: Path) -> tuple[bytes, dict[str, Entry]]:
    """The step's marker bytes (what identifies its files) and manifest, both from one read of the marker: the
    directory holds exactly its listed files, and every one but the weight files (which the worker checks as it
    reads them, once) is checked here."""
    marker = read_marker(directory)
    manifest = read_manifest(directory, marker)
    for name, entry in manifest.items():
        if not name.endswith(".safetensors"):
            check_listed(directory, name, entry)
    return marker, manifest


def _merge(reports: list[dict]) -> dict:
    """One report from every worker's: ok only if all are."""
    first = dict(reports[0])
    first["ok"] = all(r["ok"] for r in reports)
    first["reloaded"] = any(r.get("reloaded", False) for r in reports)
    return first


def _why(report: dict) -> str:
    problems = report.get("mismatched", []) + report.get("differing", [])
    return "; ".join(problems[:5]) or "no reason reported"


def _timings(report: dict) -> dict:
    keys = ("files_s", "reload_s", "verify_s", "bytes_read")
    return {k: report[k] for k in keys if k in report}


def served_weights(request: Request) -> PolicyWeights:
    """The app's `PolicyWeights` (the caller was authorized by `AdminMiddleware`)."""
    return request.app.state.weights


admin_router = APIRouter()


@admin_router.get("/policy_step")
async def policy_step(weights: Annotated[PolicyWeights, Depends(served_weights)]) -> dict:
    return await weights.current()


@admin_router.post("/update_weights")
async def update_weights(request: Request, weights: Annotated[PolicyWeights, Depends(served_weights)]) -> dict:
    body = update_request(await request.body())  # parsed here, bounded: FastAPI's parser has no depth limit
    return await weights.update(body.step, body.path)


def update_request(body: bytes) -> UpdateWeightsRequest:
    """The update request a body holds; HTTPException(422) naming what is wrong with it."""
    try:
        data = parse_json(body, MAX_JSON_DEPTH)
    except ValueError as e:
        raise HTTPException(422, f"the request body {e}") from None
    try:
        return UpdateWeightsRequest.model_validate(data)
    except ValidationError as e:  # named by field and reason; the input is not echoed (it may not encode)
        problems = [f"{'.'.join(map(str, error['loc'])) or 'body'}: {error['msg']}" for error in e.errors()]
        raise HTTPException(422, "; ".join(problems)) from None


def parse_json(body: bytes, max_depth: int) -> object:
    """JSON in UTF-8 nested at most `max_depth` arrays/objects deep, with finite numbers and UTF-8 strings;
    ValueError saying what is wrong otherwise. The depth is checked before parsing (json recurses per level)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 ({e.reason} at byte {e.start})") from None
    if json_depth(text) > max_depth:
        raise ValueError(f"is nested deeper than {max_depth} levels")
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_short_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not JSON: {e}") from None
    try:  # a "\ud800" escape parses to a lone surrogate, which no file name or response can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (an unpaired \\ud800-\\udfff escape): strings must be UTF-8") from None
    return data


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text` (brackets inside strings do not count)."""
    brackets = JSON_STRING_OR_NOT_BRACKET.sub("", text)
    depth = deepest = 0
    for bracket in brackets:
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _refuse_constant(name: str):
    raise ValueError(f"holds {name}, which is not a JSON number")


def _short_int(literal: str) -> int:
    if len(literal) > MAX_INT_DIGITS:  # Python refuses to parse past 4300 digits; no field needs more than 19
        raise ValueError(f"holds an integer of {len(literal)} digits (at most {MAX_INT_DIGITS})")
    return int(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"holds the number {literal[:32]}, which overflows a float")
    return value


class PlainJSONResponse(JSONResponse):
    """JSON escaped to ASCII: a detail quoting what a client sent (even a lone surrogate) always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def refusal(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return PlainJSONResponse({"detail": detail}, status, headers)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return refusal(error.status_code, str(error.detail), error.headers)


def build_admin_app() -> FastAPI:
    """The admin routes, as a small FastAPI app that `AdminMiddleware` forwards matching requests to."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.include_router(admin_router)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


def route_of(scope) -> str:
    """The route vLLM's router matches: the request path less the root path (vLLM's `--root-path`), stripped as
    starlette strips it (when the path is the root path or continues it with "/"). ValueError unless the route
    is plain: `PLAIN_ROUTE`, and not percent-encoded. No other spelling is normalised: it is refused."""
    path, root, raw = scope["path"], scope.get("root_path", ""), scope.get("raw_path")
    if raw is not None and raw != path.encode("utf-8", "surrogatepass"):
        raise ValueError(f"the request path {raw.decode('latin-1')!a} is percent-encoded: rl's routes need no encoding")
    route = path[len(root):] if root and (path == root or path.startswith(root + "/")) else path
    if not PLAIN_ROUTE.fullmatch(route):
        raise ValueError(f"the request path {path!a} is not a plain route (segments of letters, digits, '_', '-', "
                         "'.'; no empty, '.' or '..' segment, no trailing '/')")
    return route


class AdminMiddleware:
    """ASGI middleware, installed with vLLM's `--middleware`, in front of vLLM's app.

    Routes by allow-list, on the route vLLM's router matches (`route_of`; 400 if it is not plain):
    sends the admin paths to `build_admin_app()` once the caller is authorized (from the headers alone,
    before any body is read; bodies are bounded); passes `OPEN_PATHS` through; treats `GENERATION_PATHS`
    as generation: checks vLLM's API key when one is set, holds the request while the weights change, counts
    those in flight (`PolicyWeights.admit`) and refuses them while the weights are broken; refuses every other
    route (403). Adds `"token": "token_id:<id>"` to every logprob entry of `/inference/v1/generate` JSON
    responses (vLLM writes only `"token_id": <id>`; the `renderers` client of verifiers' training client
    requires the string form). Websockets are refused: nothing of rl uses them.
    """

    def __init__(self, app):
        self.app = app
        self.admin = build_admin_app()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "this server answers HTTP only"})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        weights = self._weights(scope)
        try:
            route = route_of(scope)
        except ValueError as e:
            return await refusal(400, str(e))(scope, receive, send)
        if route in ADMIN_PATHS:  # the admin app sees the route it was authorized for, however it was prefixed
            admin_scope = scope | {"path": route, "raw_path": route.encode(), "root_path": ""}
            return await self._admin(admin_scope, receive, send, weights.settings)
        if route in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if route not in GENERATION_PATHS:
            return await refusal(403, f"{route} is not served: rl serves its generation, health and admin routes "
                                      "only, and changes weights only through /update_weights")(scope, receive, send)
        return await self._generate(scope, receive, send, weights, route)

    async def _generate(self, scope, receive, send, weights: PolicyWeights, route: str) -> None:
        refused = api_key_refusal(scope, weights.settings)
        if refused is None and (reason := await weights.admit()):
            refused = refusal(503, reason)
        if refused is not None:
            return await refused(scope, receive, send)
        weights.in_flight += 1  # no await since admit(): an update starting now sees this request
        try:
            return await self.app(scope, receive, TokenStringRewrite(send) if route == GENERATE_PATH else send)
        finally:
            weights.in_flight -= 1

    async def _admin(self, scope, receive, send, settings: AdminSettings) -> None:
        refused = admin_refusal(scope, settings)
        if refused is None:
            body = await read_body(receive, MAX_ADMIN_BODY)
            if body is None:
                refused = refusal(413, f"the request body is over {MAX_ADMIN_BODY} bytes")
        if refused is not None:
            return await refused(scope, receive, send)
        return await self.admin(scope, replay(body, receive), send)

    def _weights(self, scope) -> PolicyWeights:
        """The one `PolicyWeights` of this app, made from vLLM's app state on the first request."""
        if not hasattr(self.admin.state, "weights"):
            vllm_state = scope["app"].state
            settings = getattr(vllm_state.args, "rl_admin", None)
            if settings is None:
                raise RuntimeError(f"{MIDDLEWARE} needs the server started by rl.inference.server.serve()")
            models = getattr(vllm_state, "openai_serving_models", None)  # set by vLLM before it serves requests
            self.admin.state.weights = PolicyWeights(vllm_state.engine_client, settings, models)
        return self.admin.state.weights


def header(scope, name: bytes) -> bytes:
    """A request header's raw bytes (b"" if absent): compared as bytes, any byte a client sends is safe."""
    return next((value for key, value in scope["headers"] if key.lower() == name), b"")


def bearer_matches(scope, secrets: tuple[str, ...]) -> bool:
    presented = header(scope, b"authorization")
    return any(hmac.compare_digest(presented, f"Bearer {secret}".encode()) for secret in secrets)


def admin_refusal(scope, settings: AdminSettings) -> JSONResponse | None:
    """Why an admin request is refused, from its headers alone; None if it may proceed."""
    if settings.admin_token is None:
        if not is_loopback((scope.get("client") or (None,))[0]):
            return refusal(403, "admin routes answer loopback clients only when no admin token is set")
        return None
    if not bearer_matches(scope, (settings.admin_token,)):
        return refusal(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    return None


def is_loopback(host) -> bool:
    """Whether a client's address is loopback: 127.0.0.0/8, ::1, or either mapped into IPv6 (::ffff:127.0.0.2).
    Anything not an IP address (a unix socket's client, a name) is not."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def api_key_refusal(scope, settings: AdminSettings) -> JSONResponse | None:
    if settings.api_keys and not bearer_matches(scope, settings.api_keys):
        return refusal(401, "missing or wrong API key", {"WWW-Authenticate": "Bearer"})
    return None


async def read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it passes `limit` bytes (the rest is never read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)  # the client went away; the app sees an empty or partial body
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """A `receive` that gives the body already read, then defers to the connection's own."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


class TokenStringRewrite:
    """ASGI `send` wrapper: buffers a 200 JSON response and adds token strings to its logprobs.

    Error responses and event streams (`"stream": true`) pass through unchanged.
    """

    def __init__(self, send):
        self.send, self.start, self.body, self.passthrough = send, None, [], False

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.start = message
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.passthrough = message["status"] != 200 or not content_type.startswith(b"application/json")
            if self.passthrough:
                await self.send(message)
            return
        if self.passthrough or message["type"] != "http.response.body":
            return await self.send(message)
        self.body.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = add_token_strings(b"".join(self.body))
        headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
        await self.send(self.start | {"headers": headers + [(b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})


def add_token_strings(body: bytes) -> bytes:
    """`{"token_id": 343, ...}` -> `{"token": "token_id:343", "token_id": 343, ...}` in every choice."""
    response = json.loads(body)
    if not isinstance(response, dict):  # vLLM answers `null` to a request whose client went away
        return body
    for choice in response.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            for item in [entry, *(entry.get("top_logprobs") or [])]:
                if "token_id" in item:  # tokens mode; text mode already has `token` strings
                    item["token"] = f"token_id:{item['token_id']}"
    return json.dumps(response).encode()


def vllm_argv(model: str, host: str, port: int, dtype: str, max_model_len: int, enforce_eager: bool, seed: int,
              gpu_memory_utilization: float, tensor_parallel_size: int, served_model_name: str | None,
              extra_args: list[str], lora: LoraServingConfig | None = None) -> list[str]:
    """vLLM's command line for our server; `extra_args` come last, so they can override."""
    argv = [
        "--model", model, "--host", host, "--port", str(port), "--dtype", dtype,
        "--max-model-len", str(max_model_len), "--seed", str(seed),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION, "--middleware", MIDDLEWARE,
    ]
    argv += ["--enforce-eager"] if enforce_eager else []
    argv += ["--served-model-name", served_model_name] if served_model_name else []
    # One adapter slot: the policy's adapter, replaced in place at every step.
    argv += ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras", "1"] if lora else []
    return argv + list(extra_args)


def check_lora_name(lora: LoraServingConfig | None, model: str, served_model_name: str | None) -> None:
    """vLLM refuses an adapter named like a served base model, but only when it is first loaded: refuse at start-up."""
    served = served_model_name or model
    if lora is not None and lora.name in (model, served):
        raise ValueError(f"inference.lora.name {lora.name!r} is the served model's name {served!r} (model {model!r}): "
                         "vLLM refuses an adapter named like its base model; choose another adapter name")


def _log_to_stderr() -> None:
    """Our INFO lines in the server's log, beside vLLM's (vLLM configures only its own loggers)."""
    package = logging.getLogger("rl")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("(rl) %(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def _own_socket_dir() -> str | None:
    """A new directory for vLLM's sockets; None where the user chose one (VLLM_RPC_BASE_PATH) or where a socket's
    path in it would pass the 107 bytes a unix socket allows (vLLM then keeps its default)."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return None
    path = tempfile.mkdtemp(prefix="vllm-")
    if len(os.fsencode(path)) + 1 + UUID_CHARS <= SOCKET_PATH_MAX:
        return path
    os.rmdir(path)
    return None


@contextlib.contextmanager
def private_ipc_dir():
    """vLLM's processes talk over ZMQ sockets named by uuid in VLLM_RPC_BASE_PATH (the system temp directory by
    default) and leave them there at exit: 7 files per server. The server gets a directory of its own for them,
    removed when it ends (a SIGKILLed server still leaves its directory)."""
    path = _own_socket_dir()
    if path is None:
        yield
        return
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield
    finally:
        del os.environ["VLLM_RPC_BASE_PATH"]
        shutil.rmtree(path, ignore_errors=True)


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    weights_dir: str | None = None,
    dtype: str = "float32",
    max_model_len: int = 2048,
    enforce_eager: bool = True,
    seed: int = 0,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    extra_args: list[str] = (),
    admin_token: str | None = None,
    served_model_name: str | None = None,
    lora: LoraServingConfig | None = None,
) -> None:
    """Run vLLM's OpenAI-compatible server with our admin routes until it is stopped.

    On CPU hosts `gpu_memory_utilization` is the fraction of the node's memory vLLM reserves. `lora`: serve one
    LoRA adapter over the model, replaced by /update_weights (None: full-weight updates).
    """
    import uvloop
    from vllm import envs as vllm_envs
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not Path(model).is_dir():
        raise ValueError(f"model {model!r} must be a local Hugging Face directory (its files are verified)")
    if tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size must be 1: weight verification reads unsharded layers")
    check_lora_name(lora, model, served_model_name)
    cli_env_setup()
    # Clients (httpx) drop an idle keep-alive connection after 5 s; a server that closes at the same
    # 5 s can close one just as a request is sent on it ("Connection error" under CPU load). Closing
    # later than any client leaves the decision to the client.
    os.environ.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(KEEP_ALIVE_S))
    argv = vllm_argv(model, host, port, dtype, max_model_len, enforce_eager, seed, gpu_memory_utilization,
                     tensor_parallel_size, served_model_name, extra_args, lora)
    args = make_arg_parser(FlexibleArgumentParser(prog="rl.inference.server")).parse_args(argv)
    configure_logging_from_args(args)
    _log_to_stderr()
    validate_parsed_serve_args(args)
    api_keys = tuple(key for key in (args.api_key or [vllm_envs.VLLM_API_KEY]) if key)  # as vLLM reads them
    args.rl_admin = AdminSettings(base_model=model, weights_dir=weights_dir, admin_token=admin_token, api_keys=api_keys,
                                  lora_name=lora.name if lora else None, lora_max_rank=lora.max_rank if lora else None)
    if current_platform.is_cpu():
        os.environ.setdefault(patches.POLL_ENV, str(patches.CPU_POLL_S))
    poll_s = patches.poll_interval()  # a bad value fails here, before vLLM starts its processes
    if poll_s is not None:
        logger.info("vLLM's shared-memory queues sleep %s s per poll (%s)", poll_s, patches.POLL_ENV)
    with private_ipc_dir():
        uvloop.run(run_server(args, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
