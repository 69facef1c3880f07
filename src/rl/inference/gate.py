"""The ASGI gate in front of vLLM's app: `AdminMiddleware`, installed with vLLM's `--middleware`, routes every
request by allow-list, answers the admin routes itself (once their bearer token, or a loopback client when no
token is set, authorizes them), checks vLLM's API key on the generation routes and holds those while
`PolicyWeights` changes the weights. Bodies are read bounded and parsed with a depth limit; what a client sends
is compared and quoted as bytes or ASCII, so no request can make an answer fail to encode. `GenerateResponse`
adds the token strings verifiers' training client reads to the logprobs of `/inference/v1/generate`.
"""

import base64
import hmac
import io
import ipaddress
import json
import logging
import math
import re
from typing import Annotated

import msgspec
import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, field_validator, model_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl import patches
from rl.inference.bodies import MAX_GENERATION_BODY, read_body, replay, salted, with_length
from rl.inference.policy import AdminSettings, PolicyWeights
from rl.inference.strict_json import parse_json
from rl.weights.offers import HOST_PATTERN, GroupSpec
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
NAME_MAX = 255  # bytes in one path component (Linux)
PATH_MAX = 4096  # bytes in a path (Linux)
MAX_ADMIN_BODY = 64 * 1024  # an update request is ~100 bytes
MAX_STEP = 2**63 - 1  # policy versions travel as int64


class TransferRequest(BaseModel):
    """This server's place in the trainer's group for one step (rl/weights/)."""

    model_config = ConfigDict(extra="forbid")

    host: Annotated[str, Field(pattern=f"^{HOST_PATTERN}$")]
    port: Annotated[StrictInt, Field(ge=1, le=65535)]
    rank: Annotated[StrictInt, Field(ge=1, le=65536, description="this server's rank; the trainer is rank 0")]
    world_size: Annotated[StrictInt, Field(ge=2, le=65537)]
    timeout_s: Annotated[StrictFloat, Field(gt=0, le=3600)]  # strict: `true` is not 1 s

    @model_validator(mode="after")
    def _rank_in_group(self) -> "TransferRequest":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")
        return self


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: Annotated[StrictInt, Field(ge=0, le=MAX_STEP, description="policy version the weights hold")]
    path: Annotated[
        str | None, Field(min_length=1, max_length=PATH_MAX, pattern=r"^[^\x00]*$",
                          description="the step's step_<step> directory, inside the weights dir")
    ] = None
    transfer: Annotated[
        TransferRequest | None, Field(description="receive the step over the wire from the trainer's group instead")
    ] = None

    @model_validator(mode="after")
    def _one_source(self) -> "UpdateWeightsRequest":
        if (self.path is None) == (self.transfer is None):
            raise ValueError("give the step's weights either as a `path` or as a `transfer`, exactly one")
        return self

    @field_validator("path")
    @classmethod
    def _fits_the_filesystem(cls, path: str | None) -> str | None:
        """A path the OS can take: UTF-8 (no lone surrogate), components of at most NAME_MAX bytes."""
        if path is None:
            return path
        try:
            encoded = path.encode()
        except UnicodeEncodeError:
            raise ValueError("holds a lone surrogate: not UTF-8") from None
        if len(encoded) > PATH_MAX:
            raise ValueError(f"is over {PATH_MAX} bytes")
        if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
            raise ValueError(f"has a component over {NAME_MAX} bytes")
        return path


def served_weights(request: Request) -> PolicyWeights:
    """The app's `PolicyWeights` (the caller was authorized by `AdminMiddleware`)."""
    return request.app.state.weights


admin_router = APIRouter()


@admin_router.get("/policy_step")
async def policy_step(weights: Annotated[PolicyWeights, Depends(served_weights)]) -> dict:
    """-> {"step": k, "weights_checksum": "...", "requests_in_flight": n, "instance": "<id>"}, with "adapter": <name>
    while an adapter is served (its weights_checksum is rl.adapter.adapter_checksum). `instance` names this server
    process: a server restarted since answers with another (and serves what it loaded at start)."""
    return await weights.current() | {"instance": weights.instance}


@admin_router.post("/update_weights")
async def update_weights(request: Request, weights: Annotated[PolicyWeights, Depends(served_weights)]) -> dict:
    """{"step": k, "path": "step_k"} -> {"step": k, "weights_checksum": "...", "instance": "<id>", ...}, with
    "adapter" as /policy_step.
    Errors are {"detail": "..."} with a 4xx status, or 500 when a reload failed."""
    body = update_request(await request.body())  # parsed here, bounded: FastAPI's parser has no depth limit
    if body.transfer is not None:
        served = await weights.receive(body.step, GroupSpec(**body.transfer.model_dump()))
    else:
        served = await weights.update(body.step, body.path)
    return served | {"instance": weights.instance}


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
    route (403). Salts every generation request with the served policy (`PolicyWeights.cache_salt`), so that no
    request reuses KV computed under other weights. Installs `GenerateResponse` as the generate route's response,
    which adds the token strings verifiers' training client reads (in each process vLLM builds this middleware in:
    every API server).
    Websockets are refused: nothing of rl uses them.
    """

    def __init__(self, app):
        self.app = app
        self.admin = build_admin_app()
        patches.render_generate_responses(GenerateResponse)

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
            if (salt := weights.cache_salt) is not None:
                body = await read_body(receive, MAX_GENERATION_BODY)
                if body is None:
                    return await refusal(413, f"the request body is over {MAX_GENERATION_BODY} bytes")(
                        scope, receive, send)
                body = salted(body, salt)
                scope, receive = with_length(scope, len(body)), replay(body, receive)
            return await self.app(scope, receive, send)
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
                raise RuntimeError("AdminMiddleware needs the server started by rl.inference.server.serve()")
            models = getattr(vllm_state, "openai_serving_models", None)  # set by vLLM before it serves requests
            self.admin.state.weights = PolicyWeights(vllm_state.engine_client, settings, models)
        return self.admin.state.weights


class AnsweredGenerationFilter(logging.Filter):
    """Drops uvicorn's access-log lines of generation requests answered below 400: one per rollout turn, they buried
    the weight updates, refusals and vLLM's own lines of a server's log (and cost ~3% of its API process's CPU,
    py-spy). A line of any other shape is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.name != "uvicorn.access" or not isinstance(args, tuple) or len(args) != 5:
            return True
        path, status = args[2], args[4]
        return not (isinstance(status, int) and status < 400 and str(path).partition("?")[0] in GENERATION_PATHS)


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


class GenerateResponse(JSONResponse):
    """The response of vLLM's `/inference/v1/generate` route (`patches.render_generate_responses` installs it as the
    route's JSONResponse). It adds `"token": "token_id:<id>"` to every logprob entry (vLLM writes only
    `"token_id": <id>`; the `renderers` client of verifiers' training client requires the string form) and writes
    the dict once, with msgspec. Before, starlette wrote it with the json module and the gate parsed that body
    again to add the strings and wrote it a second time: 3x the CPU of one msgspec pass, which grows with the
    completion (two dicts per sampled token) on the API server's one event loop.

    msgspec writes a non-finite float as `null` where json refuses it, and vLLM answers 500 then. So a response
    with a non-finite logprob, or with any field that may hold a float beside the logprobs, takes starlette's
    render as before (with the strings added). vLLM clamps logprobs to -9999.0: in practice none is non-finite.
    """

    def render(self, content) -> bytes:
        if isinstance(content, dict):
            routed_rows_for_renderers(content)
            if add_token_strings(content) and not any(content.get(name) is not None for name in FLOATS_BESIDE_LOGPROBS):
                return msgspec.json.encode(content)
        return super().render(content)


# The fields of vLLM's generate response that may hold floats, beside the choices' logprobs (a unit test reads
# vLLM's response models to keep this list whole). rl asks for none of them.
FLOATS_BESIDE_LOGPROBS = ("prompt_logprobs", "metrics", "kv_transfer_params", "ec_transfer_params")


def routed_rows_for_renderers(response: dict) -> None:
    """An MoE's routed experts (router replay), in place: vLLM writes each choice's as base64 of a `.npy` file of
    rows [prompt + completion - 1 - start, layers, top_k]; verifiers' client (`renderers`) reads
    `{"data": base64 of the raw rows, "dtype", "shape", "start"}`, `start` the first position the rows cover (the
    request's `routed_experts_prompt_start`, which the response does not repeat: found from the token counts)."""
    prompt = (response.get("usage") or {}).get("prompt_tokens")
    for choice in response.get("choices") or ():
        encoded = choice.get("routed_experts")
        if not isinstance(encoded, str) or prompt is None:
            continue
        rows = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        start = prompt + len(choice.get("token_ids") or ()) - 1 - len(rows)
        choice["routed_experts"] = {"data": base64.b64encode(np.ascontiguousarray(rows).tobytes()).decode("ascii"),
                                    "dtype": str(rows.dtype), "shape": list(rows.shape), "start": start}


def add_token_strings(response: dict) -> bool:
    """`{"token_id": 343, ...}` -> `{"token_id": 343, ..., "token": "token_id:343"}` in every logprob entry of
    every choice, in place (text mode's entries have their `token` strings already). Whether every logprob is
    finite."""
    finite = True
    for choice in response.get("choices") or ():
        for entry in (choice.get("logprobs") or {}).get("content") or ():
            for item in (entry, *(entry.get("top_logprobs") or ())):
                if "token_id" in item:
                    item["token"] = f"token_id:{item['token_id']}"
                if not -math.inf < item.get("logprob", 0.0) < math.inf:  # NaN compares false too
                    finite = False
    return finite
