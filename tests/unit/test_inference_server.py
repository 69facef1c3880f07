"""The generate route's response and the server's private IPC directory, without a server."""

import json
import os
import tempfile
import typing
from pathlib import Path
from typing import Any

import shutil

import pytest
from pydantic import BaseModel
from starlette.responses import JSONResponse

from rl import patches
from rl.inference.gate import (FLOATS_BESIDE_LOGPROBS, AnsweredGenerationFilter, GenerateResponse, PlainJSONResponse,
                               is_loopback, route_of)
from rl.inference.server import private_ipc_dir


def generate_reply(*entries) -> dict:
    return {"request_id": "r", "prompt_logprobs": None, "metrics": None,
            "choices": [{"index": 0, "token_ids": [7], "logprobs": {"content": list(entries)}}]}


def test_token_strings_are_added_and_the_reply_is_written_once_with_msgspec(monkeypatch):
    sampled = {"token_id": 7, "logprob": -0.5, "rank": 1, "top_logprobs": [{"token_id": 9, "logprob": -1.0}]}
    reply = generate_reply(sampled, {"token_id": 8, "logprob": -9999.0, "top_logprobs": []})
    expected = json.loads(json.dumps(reply))
    for entry in expected["choices"][0]["logprobs"]["content"]:
        for item in [entry, *entry["top_logprobs"]]:
            item["token"] = f"token_id:{item['token_id']}"
    monkeypatch.setattr(JSONResponse, "render", lambda self, content: pytest.fail("rendered with the json module"))
    assert json.loads(GenerateResponse(reply).body) == expected


@pytest.mark.parametrize("where", ["logprob", "top_logprob", "metrics"])
def test_a_non_finite_float_is_refused_as_vllm_refuses_it_never_written_as_null(where):
    """starlette's render refuses NaN and infinities (vLLM answers 500); msgspec would write `null`."""
    entry = {"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 9, "logprob": -0.5}]}
    reply = generate_reply(entry)
    if where == "logprob":
        entry["logprob"] = float("-inf")
    elif where == "top_logprob":
        entry["top_logprobs"][0]["logprob"] = float("nan")
    else:
        reply["metrics"] = {"time_to_first_token_ms": float("nan")}
    with pytest.raises(ValueError, match="not JSON compliant"):
        GenerateResponse(reply)


def test_an_error_or_null_reply_is_written_unchanged():
    """vLLM answers `null` when the client went away mid-request."""
    assert GenerateResponse(None).body == b"null"
    error = {"error": {"message": "bad ids", "type": "BadRequestError", "code": 400}}
    assert json.loads(GenerateResponse(error, 400).body) == error


def may_hold_float(annotation, seen=()) -> bool:
    if annotation in (float, Any):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation not in seen and any(may_hold_float(field.annotation, (*seen, annotation))
                                              for field in annotation.model_fields.values())
    return any(may_hold_float(arg, seen) for arg in typing.get_args(annotation))


def models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in models_in(arg)]


def float_fields(model: type[BaseModel]) -> set[str]:
    return {name for name, field in model.model_fields.items() if may_hold_float(field.annotation)}


def test_every_float_field_of_vllms_generate_reply_is_checked_before_msgspec_writes_it():
    """msgspec writes a non-finite float as null: GenerateResponse checks every logprob entry and leaves a reply
    with another float-bearing field to starlette. A vLLM that adds a float field fails here, not in a run."""
    from vllm.entrypoints.scale_out.token_in_token_out import protocol

    for reply in (protocol.GenerateTokensResponse, protocol.GenerateTextResponse):
        assert float_fields(reply) - {"choices"} <= set(FLOATS_BESIDE_LOGPROBS), reply
        for choice in models_in(reply.model_fields["choices"].annotation):
            assert float_fields(choice) == {"logprobs"}, choice
            for logprobs in models_in(choice.model_fields["logprobs"].annotation):
                assert float_fields(logprobs) == {"content"}, logprobs
                for entry in models_in(logprobs.model_fields["content"].annotation):
                    assert float_fields(entry) == {"logprob", "top_logprobs"}, entry
                    for top in models_in(entry.model_fields["top_logprobs"].annotation):
                        assert float_fields(top) == {"logprob"}, top


def test_the_generate_route_answers_through_generate_response(monkeypatch):
    from vllm.entrypoints.scale_out.token_in_token_out import api_router

    monkeypatch.setattr(api_router, "JSONResponse", JSONResponse)
    patches.render_generate_responses(GenerateResponse)
    patches.render_generate_responses(GenerateResponse)  # each API server's gate applies it: twice is once
    assert api_router.JSONResponse is GenerateResponse
    monkeypatch.setattr(api_router, "JSONResponse", PlainJSONResponse)
    with pytest.raises(patches.PatchTargetMissing, match="not starlette's JSONResponse"):
        patches.render_generate_responses(GenerateResponse)


def test_the_access_log_leaves_out_answered_generation_requests_only(caplog):
    import logging

    access = logging.getLogger("uvicorn.access")
    access.addFilter(answered := AnsweredGenerationFilter())
    try:
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            for path, status in [("/inference/v1/generate", 200), ("/v1/chat/completions", 200),
                                 ("/v1/completions?x=1", 200), ("/inference/v1/generate", 503),
                                 ("/v1/chat/completions", 401), ("/update_weights", 200), ("/health", 200)]:
                access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", path, "1.1", status)  # as uvicorn
            access.info("a line of another shape")
    finally:
        access.removeFilter(answered)
    assert [record.getMessage().split('"')[1] if record.args else record.getMessage() for record in caplog.records] == [
        "POST /inference/v1/generate HTTP/1.1", "POST /v1/chat/completions HTTP/1.1", "POST /update_weights HTTP/1.1",
        "POST /health HTTP/1.1", "a line of another shape"]


def test_vllm_ipc_sockets_get_a_directory_removed_at_exit(monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with pytest.raises(RuntimeError), private_ipc_dir():
        ipc = Path(os.environ["VLLM_RPC_BASE_PATH"])
        (ipc / "engine-socket").touch()  # a file vLLM would leave behind
        raise RuntimeError("the server failed")
    assert ipc.name.startswith("vllm-") and not ipc.exists()
    assert "VLLM_RPC_BASE_PATH" not in os.environ


def test_a_user_chosen_ipc_path_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    with private_ipc_dir():
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)
    assert tmp_path.is_dir() and os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)


def test_a_temp_directory_too_deep_for_a_socket_path_keeps_vllms_default(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with private_ipc_dir():
        assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []


# ---- AdminMiddleware in front of a stand-in for vLLM's app ----

class FakeWeights:
    """Stands in for PolicyWeights: admit() answers `refusal`; records how many were in flight and the updates."""

    def __init__(self, refusal=None, admin_token="admin-secret", api_keys=("api-secret",), cache_salt=None):
        from rl.inference.policy import AdminSettings

        self.settings = AdminSettings("model", None, admin_token, api_keys)
        self.refusal, self.in_flight, self.seen_in_flight, self.updates = refusal, 0, [], []
        self.instance, self.cache_salt, self.bodies = "fake", cache_salt, []

    async def admit(self):
        return self.refusal

    async def current(self):
        return {"step": 0}

    async def update(self, step, path):
        self.updates.append((step, path))
        return {"step": step}


def call(weights: FakeWeights, path: str, headers: dict | None = None, body: bytes = b"", method: str = "POST",
         scope_type: str = "http", root_path: str = "", raw_path: bytes | None = None,
         client: str = "10.0.0.2") -> tuple[int | None, dict, list, int]:
    """Send one request through AdminMiddleware, as uvicorn presents it (`raw_path` by default the path as sent,
    `root_path` as vLLM's --root-path sets it); (status, JSON body, messages sent, body chunks read)."""
    import asyncio

    from rl.inference.gate import AdminMiddleware

    async def vllm_app(scope, receive, send):  # answers 200 "generated", noting the requests in flight
        weights.seen_in_flight.append(weights.in_flight)
        if weights.cache_salt is not None:  # the body as vLLM reads it, and the length its headers give
            message, body = {"more_body": True}, b""
            while message.get("more_body"):
                message = await receive()
                body += message.get("body", b"")
            weights.bodies.append((body, dict(scope["headers"]).get(b"content-length")))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"detail": "generated"}'})

    middleware = AdminMiddleware(vllm_app)
    middleware.admin.state.weights = weights
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]
    read = 0

    async def receive():
        nonlocal read
        read += 1
        if read <= len(chunks):
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    if raw_path is None:
        raw_path = path.encode("utf-8", "surrogatepass")
    scope = {"type": scope_type, "path": path, "raw_path": raw_path, "method": method, "client": (client, 5000),
             "app": None, "query_string": b"", "root_path": root_path,
             "headers": [(k.lower().encode(), v if isinstance(v, bytes) else v.encode())
                         for k, v in (headers or {}).items()]}
    asyncio.run(middleware(scope, receive, send))
    start = next((m for m in sent if m["type"] == "http.response.start"), {})
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start.get("status"), json.loads(content) if content else {}, sent, read


API = {"Authorization": "Bearer api-secret"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_generation_routes_need_the_key_and_are_held_and_counted(path):
    weights = FakeWeights()
    assert call(weights, path)[:2] == (401, {"detail": "missing or wrong API key"})  # the key is checked everywhere
    assert call(weights, path, API)[0] == 200 and weights.seen_in_flight == [1]  # counted in flight
    broken = FakeWeights(refusal="the weights are broken")
    assert call(broken, path, API)[:2] == (503, {"detail": "the weights are broken"}) and broken.seen_in_flight == []


@pytest.mark.parametrize("path", ["/health", "/ping", "/metrics", "/version", "/v1/models", "/load"])
def test_open_routes_pass_through_without_key_or_hold(path):
    weights = FakeWeights(refusal="held")
    assert call(weights, path, method="GET")[0] == 200 and weights.seen_in_flight == [0]


def test_admin_requests_are_authorized_before_their_body_is_read():
    weights = FakeWeights()
    huge = b"x" * (20 << 20)
    status, body, _, read = call(weights, "/update_weights", {"Authorization": "Bearer wrong"}, huge)
    assert (status, read) == (401, 0) and body == {"detail": "missing or wrong bearer token"}
    status, _, _, read = call(weights, "/update_weights", {"Authorization": "Bearer admin-secret"}, huge)
    assert status == 413 and read == 2  # stopped after the chunk that passed the limit
    for odd in ("Bearer \u00e9t\u00e9".encode("utf-8"), b"Bearer \xff\xfe", b"\x00"):
        assert call(weights, "/policy_step", {"Authorization": odd}, method="GET")[0] == 401
        assert call(weights, "/v1/completions", {"Authorization": odd})[0] == 401
    no_token = FakeWeights(admin_token=None)  # then only loopback clients; this one is 10.0.0.2
    assert call(no_token, "/policy_step", method="GET")[:2] == (
        403, {"detail": "admin routes answer loopback clients only when no admin token is set"})


# Present vLLM routes (control, development, other APIs) and routes no vLLM has yet: all outside the allow-list.
UNLISTED = ["/scale_elastic_ep", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc", "/pause",
            "/inference/v1/abort_requests", "/weight_checker", "/invocations", "/generative_scoring", "/tokenize",
            "/pooling", "/some/future/route", "/update_weights.json", "/v1/models/extra", "/" + "a" * 300]


@pytest.mark.parametrize("path", UNLISTED, ids=lambda path: path[:40])
def test_routes_off_the_allow_list_are_refused_even_with_the_key(path):
    weights = FakeWeights()
    for headers in (API, {"Authorization": "Bearer admin-secret"}, {}):
        status, body, _, read = call(weights, path, headers)
        assert status == 403 and "not served" in body["detail"] and read == 0
    assert weights.seen_in_flight == []


# Spellings of allowed or refused routes that a normalising server might read as another route.
NOT_PLAIN = ["//v1/models", "/v1/models/", "/v1//models", "/v1/../pause", "/./pause", "/v1/./models", "/", "",
             "/v1/mod\u00e9ls", "/pause\x00", "/a\ud800"]


@pytest.mark.parametrize("path", NOT_PLAIN, ids=ascii)
def test_paths_not_in_plain_form_are_refused_not_normalised(path):
    weights = FakeWeights()
    status, body, _, _ = call(weights, path, API)
    assert status == 400 and "is not a plain route" in body["detail"]
    assert weights.seen_in_flight == []


def test_a_percent_encoded_path_is_refused():
    scope = {"path": "/v1/models", "raw_path": b"/v1%2Fmodels", "root_path": ""}
    with pytest.raises(ValueError, match="is percent-encoded"):
        route_of(scope)
    weights = FakeWeights()
    assert call(weights, "/v1/models", raw_path=b"/v1%2fmodels", method="GET")[0] == 400
    assert call(weights, "/v1/models", raw_path=b"/v1/models", method="GET")[0] == 200


ROOT_PATH_ROUTES = [  # (path, root path, the route the rules see: what starlette's router matches)
    ("/api/pause", "/api", "/pause"),
    ("/pause", "/api", "/pause"),  # starlette routes a path without the prefix as it is
    ("/api/v1/chat/completions", "/api", "/v1/chat/completions"),
    ("/api/update_weights", "/api", "/update_weights"),
    ("/apix/pause", "/api", "/apix/pause"),  # not the root path followed by "/": not stripped
    ("/api/api/pause", "/api", "/api/pause"),  # stripped once, as the router strips it
    ("/v1/models", "", "/v1/models"),
]


@pytest.mark.parametrize("path, root, route", ROOT_PATH_ROUTES)
def test_rules_see_the_route_less_the_root_path(path, root, route):
    assert route_of({"path": path, "root_path": root, "raw_path": path.encode()}) == route


def test_every_rule_applies_under_a_root_path():
    weights = FakeWeights()
    root = {"root_path": "/api"}
    assert call(weights, "/api/pause", API, **root)[0] == 403
    assert call(weights, "/api/collective_rpc", API, **root)[0] == 403
    assert call(weights, "/api//pause", API, **root)[0] == 400
    assert call(weights, "/api/health", method="GET", **root)[0] == 200
    assert call(weights, "/api/v1/chat/completions", **root)[0] == 401
    assert call(weights, "/api/v1/chat/completions", API, **root)[0] == 200
    assert call(weights, "/api/update_weights", {"Authorization": "Bearer wrong"}, **root)[0] == 401


def test_the_admin_app_gets_the_route_it_was_authorized_for():
    """Under a root path the admin app answers the route checked, not a prefixed path it might route elsewhere."""
    weights = FakeWeights()
    status, body, _, _ = call(weights, "/api/update_weights", {"Authorization": "Bearer admin-secret"},
                              b'{"step": 1, "path": "step_1"}', root_path="/api")
    assert (status, body, weights.updates) == (200, {"step": 1, "instance": "fake"}, [(1, "step_1")])
    assert call(weights, "/api/policy_step", {"Authorization": "Bearer admin-secret"}, method="GET",
                root_path="/api")[:2] == (200, {"step": 0, "instance": "fake"})


def test_websockets_are_refused():
    _, _, sent, _ = call(FakeWeights(), "/v1/realtime", API, scope_type="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "this server answers HTTP only"}]


ADMIN = {"Authorization": "Bearer admin-secret"}
# Update bodies no client should send: each is a 422 naming the problem, never a 500, and nothing is updated.
BAD_BODIES = [
    ("inf", b'{"step": 1e400, "path": "step_1"}', "1e400, which overflows a float"),
    ("nan", b'{"step": NaN, "path": "step_1"}', "NaN, which is not a JSON number"),
    ("minus-infinity", b'{"step": -Infinity, "path": "step_1"}', "-Infinity"),
    ("lone-surrogate-path", b'{"step": 1, "path": "step_1\\ud800"}', "lone surrogate"),
    ("lone-surrogate-key", b'{"step": 1, "path": "step_1", "\\udc80": 0}', "lone surrogate"),
    ("deep-nesting", b'{"step": ' + b"[" * 30_000 + b"]" * 30_000 + b', "path": "step_1"}', "nested deeper than 8"),
    ("long-component", b'{"step": 1, "path": "' + b"a" * 256 + b'/step_1"}',
     "path: Value error, has a component over 255"),
    ("long-path", b'{"step": 1, "path": "' + b"a/" * 2100 + b'step_1"}', "path: String should have at most 4096"),
    ("many-digits", b'{"step": ' + b"9" * 5000 + b', "path": "step_1"}', "an integer of 5000 digits"),
    ("past-int64", b'{"step": 9223372036854775808, "path": "step_1"}', "step: Input should be less than or equal"),
    ("fraction", b'{"step": 1.5, "path": "step_1"}', "step: Input should be a valid integer"),
    ("not-utf8", b'{"step": 1, "path": "\xff"}', "is not UTF-8"),
    ("not-json", b'{"step": 1,', "is not JSON"),
    ("not-an-object", b"[1, 2]", "body: Input should be a valid dictionary"),
    ("extra-field", b'{"step": 1, "path": "step_1", "force": true}', "force: Extra inputs are not permitted"),
    ("nul-in-path", b'{"step": 1, "path": "step_1\\u0000"}', "path: String should match pattern"),
]


@pytest.mark.parametrize("body, named", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_malformed_update_bodies_are_422_naming_the_problem(body, named):
    weights = FakeWeights()
    status, answer, _, _ = call(weights, "/update_weights", ADMIN, body)
    assert status == 422 and named in answer["detail"], answer
    assert weights.updates == []


def test_a_well_formed_update_passes():
    weights = FakeWeights()
    assert call(weights, "/update_weights", ADMIN, b'{"step": 3, "path": "step_3"}')[0] == 200
    assert weights.updates == [(3, "step_3")]


def test_error_details_always_encode():
    """A detail quoting a lone surrogate (say, from a refused path) is escaped, not a UnicodeEncodeError."""
    from rl.inference.gate import refusal

    assert json.loads(refusal(400, "path '\ud800'").body) == {"detail": "path '\ud800'"}


@pytest.mark.parametrize("client, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("127.255.255.254", True), ("::1", True), ("::ffff:127.0.0.2", True),
    ("10.0.0.2", False), ("::ffff:10.0.0.2", False), ("0.0.0.0", False), ("::", False), ("fe80::1", False),
    ("localhost", False), ("", False), (None, False),
])
def test_loopback_is_127_slash_8_and_ipv6_loopback(client, loopback):
    assert is_loopback(client) is loopback


def test_without_an_admin_token_admin_routes_answer_loopback_clients_only():
    no_token = FakeWeights(admin_token=None)
    for client in ("127.0.0.2", "::1", "::ffff:127.0.0.1"):
        assert call(no_token, "/policy_step", method="GET", client=client)[:2] == (200, {"step": 0, "instance": "fake"})
    assert call(no_token, "/policy_step", method="GET", client="192.168.0.7")[0] == 403


def test_a_path_past_the_os_limit_is_a_bad_request_not_a_crash(tmp_path):
    from fastapi import HTTPException

    from rl.inference.step_dirs import resolve_step_dir

    with pytest.raises(HTTPException) as refused:
        resolve_step_dir(str(tmp_path), "/".join(["a" * 250] * 20), 1)  # every component fits; the path does not
    assert refused.value.status_code == 400 and "cannot be resolved" in refused.value.detail


# ---- a LoRA server's PolicyWeights, before a stand-in for vLLM's engine and model registry ----

LORA = "policy-lora"


def step_of(copy: str) -> str:
    """The step a private copy holds (its directory is named `step_k-<random>`)."""
    return Path(copy).name.split("-")[0]


class FakeEngine:
    """vLLM's engine client as a LoRA server uses it: `add_lora` keeps the request in slot 1 (or raises for a step in
    `add_fails`); the worker's read-back fails for a step in `verify_fails`; `generate` gives one token whose logprob
    is `probe_logprob`; every call is recorded. Steps are named as their directories (`step_1`): the engine sees the
    server's private copies only."""

    def __init__(self, add_fails=(), verify_fails=(), read_reports=None):
        self.add_fails, self.verify_fails, self.read_reports = set(add_fails), set(verify_fails), read_reports or {}
        self.loras, self.calls, self.version, self.probe_logprob = {}, [], None, -1.0

    async def collective_rpc(self, method, args=()):
        self.calls.append(method)
        if method == "rl_check_served":
            return [{"ok": True, "checksum": "base"}]
        if method == "rl_read_adapter":
            step = step_of(args[0])
            read = {"ok": True, "reloaded": False, "checksum": f"sum of {step}", "bytes_read": 1}
            return [self.read_reports.get(step, read)]
        assert method == "rl_verify_adapter" and args == (1,)
        step = step_of(self.loras[1].lora_path)
        if step in self.verify_fails:
            return [{"ok": False, "mismatched": [], "differing": [f"{step}: lora_B served differs"]}]
        return [{"ok": True, "mismatched": [], "differing": [], "checksum": f"sum of {step}"}]

    async def add_lora(self, request):
        self.calls.append(("add_lora", step_of(request.lora_path), request.load_inplace))
        if step_of(request.lora_path) in self.add_fails:
            raise RuntimeError("Call to add_lora method failed: no")
        self.loras[request.lora_int_id] = request

    async def generate(self, prompt, params, request_id, lora_request=None):
        from types import SimpleNamespace

        self.calls.append(("generate", lora_request and step_of(lora_request.lora_path)))
        logprob = SimpleNamespace(logprob=self.probe_logprob)
        yield SimpleNamespace(outputs=[SimpleNamespace(logprobs=[{7: logprob}])])

    async def remove_lora(self, lora_id):
        self.calls.append(("remove_lora", lora_id))
        return self.loras.pop(lora_id, None) is not None

    async def list_loras(self):
        return set(self.loras)

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append("reset_prefix_cache")

    async def update_weight_version(self, version):
        self.version = version

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(("pause", mode))

    async def resume_generation(self):
        self.calls.append("resume")


class FakeModels:
    """vLLM's OpenAI model registry: adapter name -> the LoRARequest every request naming it carries."""

    def __init__(self):
        self.lora_requests = {}


def adapter_step(weights, step: int, full: bool = False) -> str:
    """weights/step_k holding an adapter (or full weights), marked STABLE; the server checks the manifest only."""
    from rl.manifest import mark_stable

    directory = weights / f"step_{step}"
    directory.mkdir()
    if full:
        (directory / "model.safetensors").write_bytes(b"weights")
        (directory / "config.json").write_text("{}")
    else:
        (directory / "adapter_model.safetensors").write_bytes(b"tensors")
        (directory / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    mark_stable(directory, step=step)
    return str(directory.resolve())


def lora_weights(tmp_path, engine, lora_name=LORA):
    from rl.inference.policy import AdminSettings, PolicyWeights

    (tmp_path / "model").mkdir(parents=True)
    (tmp_path / "weights").mkdir()
    settings = AdminSettings(base_model=str(tmp_path / "model"), weights_dir=str(tmp_path / "weights"),
                             admin_token=None, lora_name=lora_name)
    return PolicyWeights(engine, settings, FakeModels()), tmp_path / "weights"


def run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def refusal_of(coroutine):
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as refused:
        run(coroutine)
    return refused.value.status_code, refused.value.detail


def test_an_adapter_loads_in_place_and_requests_get_it_without_load_inplace(tmp_path):
    """vLLM keeps the registry's request on every later request; with load_inplace still set, every scheduler step
    would reload the adapter from disk."""
    engine = FakeEngine()
    weights, root = lora_weights(tmp_path, engine)
    step_0 = adapter_step(root, 0)
    assert run(weights.current()) == {"step": 0, "weights_checksum": "base", "requests_in_flight": 0}
    answer = run(weights.update(0, step_0))  # step 0's adapter over the base model served as step 0
    assert answer["weights_checksum"] == "sum of step_0" and answer["adapter"] == LORA and engine.version == "0"
    assert ("add_lora", "step_0", True) in engine.calls
    registered = weights.models.lora_requests[LORA]
    assert (registered.lora_int_id, step_of(registered.lora_path), registered.load_inplace) == (1, "step_0", False)
    copy_0 = Path(registered.lora_path)  # vLLM loads the server's private copy, never the user's directory
    assert copy_0 != Path(step_0) and not copy_0.is_relative_to(root) and oct(copy_0.stat().st_mode)[-3:] == "700"
    assert {p.name: p.read_bytes() for p in copy_0.iterdir()} == {
        p.name: p.read_bytes() for p in Path(step_0).iterdir() if p.name != "STABLE"}
    assert run(weights.current()) == {"step": 0, "weights_checksum": "sum of step_0", "requests_in_flight": 0,
                                      "adapter": LORA}

    step_1 = adapter_step(root, 1)
    calls = len(engine.calls)
    assert run(weights.update(1, step_1))["weights_checksum"] == "sum of step_1"
    loaded = engine.calls[calls:]
    assert loaded == ["rl_read_adapter", ("add_lora", "step_1", True), "rl_verify_adapter"]  # no cache reset:
    assert weights.cache_salt == "rl-policy-1"  # requests from now on are salted with the new step instead
    registered = weights.models.lora_requests[LORA]
    assert step_of(registered.lora_path) == "step_1" and not registered.load_inplace
    assert not copy_0.exists()  # the copy of the adapter served before is removed once another verifies
    calls = len(engine.calls)
    assert run(weights.update(1, step_1)) == {"step": 1, "weights_checksum": "sum of step_1"}  # retried: no reload
    assert engine.calls[calls:] == []


def test_a_failed_read_back_re_adds_the_previous_adapter(tmp_path):
    weights, root = lora_weights(tmp_path, engine := FakeEngine())
    step_1, step_2 = adapter_step(root, 1), adapter_step(root, 2)
    engine.verify_fails.add("step_2")
    run(weights.update(1, step_1))
    copy_1 = weights.adapter_copy
    shutil.rmtree(step_1)  # the rollback reloads the server's own copy: the user's directory is not needed
    status, detail = refusal_of(weights.update(2, step_2))
    assert status == 500 and "lora_B served differs" in detail
    assert f"rolled back to step 1 (adapter '{LORA}'), which verifies" in detail
    assert [c for c in engine.calls if c[0] == "add_lora"] == [
        ("add_lora", "step_1", True), ("add_lora", "step_2", True), ("add_lora", "step_1", True)]
    registered = weights.models.lora_requests[LORA]
    assert registered.lora_path == copy_1 and not registered.load_inplace
    assert ("generate", "step_1") in engine.calls  # the served state proved clean after the failed load
    assert run(weights.current())["weights_checksum"] == "sum of step_1" and engine.version == "1"
    assert [p.name.split("-")[0] for p in Path(copy_1).parent.iterdir()] == ["step_1"]  # step 2's copy removed


def test_a_first_adapter_that_fails_leaves_the_base_model_served(tmp_path):
    weights, root = lora_weights(tmp_path, engine := FakeEngine())
    step_0 = adapter_step(root, 0)
    engine.add_fails.add("step_0")
    status, detail = refusal_of(weights.update(0, step_0))
    assert status == 500 and "vLLM's add_lora failed" in detail and "(the base model), which verifies" in detail
    assert ("remove_lora", 1) in engine.calls and LORA not in weights.models.lora_requests
    assert run(weights.current()) == {"step": 0, "weights_checksum": "base", "requests_in_flight": 0}


def test_a_failed_rollback_breaks_the_server(tmp_path):
    weights, root = lora_weights(tmp_path, engine := FakeEngine())
    step_1, step_2 = adapter_step(root, 1), adapter_step(root, 2)
    run(weights.update(1, step_1))
    engine.verify_fails |= {"step_1", "step_2"}
    status, detail = refusal_of(weights.update(2, step_2))
    assert status == 500 and "rollback to step 1 failed too" in detail
    assert refusal_of(weights.current())[0] == 503 and run(weights.admit()) == weights.broken


def test_the_first_generation_request_waits_for_the_base_model_verified_and_labelled_step_0(tmp_path):
    """vLLM labels what it samples "default" until a version is set: no generation request enters before step 0 is
    set, once the base model verifies; one that does not is refused, each time."""
    weights, _ = lora_weights(tmp_path / "ok", engine := FakeEngine())
    assert run(weights.admit()) is None and engine.version == "0" and engine.calls == ["rl_check_served"]
    assert run(weights.admit()) is None and engine.calls == ["rl_check_served"]  # verified once

    class Mismatched(FakeEngine):
        async def collective_rpc(self, method, args=()):
            self.calls.append(method)
            return [{"ok": False, "mismatched": ["model.norm.weight differs"], "differing": []}]

    weights, _ = lora_weights(tmp_path / "mismatched", engine := Mismatched())
    for _ in range(2):
        assert "do not match" in run(weights.admit()) and engine.version is None
    assert engine.calls == ["rl_check_served"] * 2


def test_a_refused_adapter_reaches_nothing_of_vllm(tmp_path):
    corrupt = {"ok": False, "reloaded": False, "corrupt": "step_1/adapter_model.safetensors fails its CRC-32 check",
               "mismatched": [], "differing": []}
    misfit = {"ok": False, "reloaded": False, "mismatched": ["the adapter targets nothing"], "differing": []}
    weights, root = lora_weights(tmp_path, engine := FakeEngine(read_reports={"step_1": corrupt, "step_2": misfit}))
    assert refusal_of(weights.update(1, adapter_step(root, 1)))[0] == 422
    status, detail = refusal_of(weights.update(2, adapter_step(root, 2)))
    assert status == 400 and "targets nothing" in detail
    assert not [c for c in engine.calls if c[0] in ("add_lora", "remove_lora")]


def test_a_failed_load_whose_served_state_computes_nan_breaks_the_server(tmp_path):
    """After any failed load the server proves what it serves with one generated token; non-finite logprobs (an
    adapter's inf that vLLM kept somewhere) stop generation instead of serving NaN."""
    weights, root = lora_weights(tmp_path, engine := FakeEngine())
    run(weights.update(1, adapter_step(root, 1)))
    engine.verify_fails.add("step_2")
    engine.probe_logprob = float("nan")
    status, detail = refusal_of(weights.update(2, adapter_step(root, 2)))
    assert status == 500 and "rolled back to step 1" in detail
    assert weights.broken and "logprobs are not finite" in weights.broken
    assert refusal_of(weights.current())[0] == 503 and ("pause", "abort") in engine.calls


def test_steps_of_the_other_kind_are_400_naming_it(tmp_path):
    weights, root = lora_weights(tmp_path, FakeEngine())
    status, detail = refusal_of(weights.update(1, adapter_step(root, 1, full=True)))
    assert status == 400 and "holds full weights" in detail and LORA in detail
    plain, root = lora_weights(tmp_path / "plain", FakeEngine(), lora_name=None)
    status, detail = refusal_of(plain.update(1, adapter_step(root, 1)))
    assert status == 400 and "is a LoRA adapter step" in detail and "without LoRA" in detail


def test_adapter_steps_follow_the_step_rules(tmp_path):
    weights, root = lora_weights(tmp_path, FakeEngine())
    run(weights.update(2, adapter_step(root, 2)))
    assert refusal_of(weights.update(0, adapter_step(root, 0)))[0] == 409  # older than served
    (root / "again").mkdir()
    other_2 = adapter_step(root / "again", 2)  # the same step from another directory
    assert refusal_of(weights.update(2, other_2))[0] == 409


def test_a_lora_server_starts_with_vllms_lora_flags_and_a_name_unlike_the_model():
    from rl.inference.config import InferenceConfig, LoraServingConfig
    from rl.inference.server import check_lora_name, vllm_argv

    lora = LoraServingConfig(name="policy-lora", max_rank=8)
    config = InferenceConfig(model={"name": "org/model"}, dtype="float32", lora=lora, extra_args=["--max-loras", "2"])
    argv = vllm_argv(config, "/m", 0.2, ["--max-loras", "3"])  # the host's arguments, then the user's, override
    assert argv[-9:] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-loras", "3",
                         "--max-loras", "2"]
    assert "--enable-lora" not in vllm_argv(InferenceConfig(dtype="auto"), "/m", 0.2, [])
    check_lora_name(config, "/m")
    for model_dir, name in (("/m", "policy-lora"), ("policy-lora", "org/model")):
        with pytest.raises(ValueError, match="inference.lora.name 'policy-lora' is the served model's name"):
            check_lora_name(InferenceConfig(model={"name": name}, lora=lora), model_dir)


def test_an_eager_cpu_server_turns_torch_compile_off_in_vllms_processes(monkeypatch):
    """vLLM torch.compiles its sampler's rank count even under --enforce-eager; on CPU inductor built it with gcc at
    each server's first request (10-12 s). Eager means eager there, unless the environment already decides. vLLM's
    processes forked on CPU do not import torch again: they inherit the switch, not the variable."""
    import torch._dynamo.config

    from rl.inference.server import COMPILE_OFF, INDUCTOR_CACHE, cpu_compile_policy

    monkeypatch.delenv(COMPILE_OFF, raising=False)
    with cpu_compile_policy(enforce_eager=True):
        assert os.environ[COMPILE_OFF] == "1" and "rl-inductor-" not in os.environ.get(INDUCTOR_CACHE, "")
        child = os.fork()
        if child == 0:
            os._exit(0 if torch._dynamo.config.disable else 1)
        assert os.waitpid(child, 0)[1] == 0, "a forked process still compiles"
    assert COMPILE_OFF not in os.environ and not torch._dynamo.config.disable
    monkeypatch.setenv(COMPILE_OFF, "0")
    with cpu_compile_policy(enforce_eager=True):
        assert os.environ[COMPILE_OFF] == "0"  # the user's choice is kept


def test_a_compiling_cpu_server_compiles_into_a_cache_of_its_own_removed_when_it_ends(monkeypatch):
    """A server killed while inductor compiled a kernel left a truncated .so in the host's shared cache, which
    failed every later server ("file too short"): on CPU hosts each server that compiles has its own cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from rl.inference.server import COMPILE_OFF, INDUCTOR_CACHE, cpu_compile_policy

    monkeypatch.delenv(COMPILE_OFF, raising=False)
    monkeypatch.setenv(INDUCTOR_CACHE, default_cache_dir())  # as torch sets it when imported
    with cpu_compile_policy(enforce_eager=False):
        cache = Path(os.environ[INDUCTOR_CACHE])
        assert cache.is_dir() and cache.name.startswith("rl-inductor-") and COMPILE_OFF not in os.environ
    assert os.environ[INDUCTOR_CACHE] == default_cache_dir() and not cache.exists()
    monkeypatch.setenv(INDUCTOR_CACHE, "/chosen")
    with cpu_compile_policy(enforce_eager=False):
        assert os.environ[INDUCTOR_CACHE] == "/chosen"  # the user's choice is kept


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/chat/completions"])
def test_generation_requests_are_salted_with_the_served_policy(path):
    """Each policy's KV is its own (vLLM's cache_salt): the salt is the body's last member, so it replaces one the
    client sent; the body's length is set again; a body that is no JSON object reaches vLLM as sent."""
    weights = FakeWeights(cache_salt="rl-policy-3")
    for body, salted in [(b'{"prompt": [1, 2]}', {"prompt": [1, 2], "cache_salt": "rl-policy-3"}),
                         (b'{"cache_salt": "mine", "n": 2} \n', {"cache_salt": "rl-policy-3", "n": 2}),
                         (b"{ }", {"cache_salt": "rl-policy-3"})]:
        assert call(weights, path, API, body)[0] == 200
        seen, length = weights.bodies.pop()
        assert json.loads(seen) == salted and length == str(len(seen)).encode()
    assert call(weights, path, API, b"[1, 2]")[0] == 200 and weights.bodies.pop()[0] == b"[1, 2]"


@pytest.mark.parametrize("reset", [False, True])
def test_an_update_resets_the_prefix_cache_only_where_requests_are_not_salted(tmp_path, reset):
    from rl.inference.policy import AdminSettings, PolicyWeights

    engine = FakeEngine()
    weights, root = lora_weights(tmp_path, engine)
    weights = PolicyWeights(engine, AdminSettings(**(vars(weights.settings) | {"salt_per_policy": not reset})),
                            FakeModels())
    run(weights.update(1, adapter_step(root, 1)))
    assert ("reset_prefix_cache" in engine.calls) == reset
    assert weights.cache_salt == (None if reset else "rl-policy-1")


def test_servers_schedule_by_request_priority_and_a_users_extra_args_may_choose_otherwise():
    """Continuous dispatch numbers its groups as request priorities (the oldest episode first): rl's servers read
    them; a user's extra_args come last and win."""
    from rl.inference.config import InferenceConfig
    from rl.inference.server import vllm_argv

    argv = vllm_argv(InferenceConfig(dtype="float32"), "/m", 0.2, [])
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    fcfs = vllm_argv(InferenceConfig(dtype="float32", extra_args=["--scheduling-policy", "fcfs"]), "/m", 0.2, [])
    assert fcfs[-2:] == ["--scheduling-policy", "fcfs"]
