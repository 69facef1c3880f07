"""The generate route's response rewrite and the server's private IPC directory, without a server."""

import json
import os
import tempfile
from pathlib import Path

import pytest

from rl.inference.server import add_token_strings, private_ipc_dir


def test_token_strings_are_added_to_token_id_logprobs():
    body = {"choices": [{"logprobs": {"content": [{"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 9}]}]}}]}
    entry = json.loads(add_token_strings(json.dumps(body).encode()))["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:7" and entry["top_logprobs"][0]["token"] == "token_id:9"


def test_a_null_body_passes_unchanged():
    """vLLM answers `null` when the client went away mid-request; that must not raise in the server."""
    assert add_token_strings(b"null") == b"null"


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
    """Stands in for PolicyWeights: admit() answers `refusal`; records how many were in flight."""

    def __init__(self, refusal=None, admin_token="admin-secret", api_keys=("api-secret",)):
        from rl.inference.server import AdminSettings

        self.settings = AdminSettings("model", None, admin_token, api_keys)
        self.refusal, self.in_flight, self.seen_in_flight = refusal, 0, []

    async def admit(self):
        return self.refusal


def call(weights: FakeWeights, path: str, headers: dict | None = None, body: bytes = b"", method: str = "POST",
         scope_type: str = "http") -> tuple[int | None, dict, list, int]:
    """Send one request through AdminMiddleware; (status, JSON body, messages sent, body chunks read)."""
    import asyncio

    from rl.inference.server import AdminMiddleware

    async def vllm_app(scope, receive, send):  # answers 200 "generated", noting the requests in flight
        weights.seen_in_flight.append(weights.in_flight)
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

    scope = {"type": scope_type, "path": path, "method": method, "client": ("10.0.0.2", 5000), "app": None,
             "headers": [(k.lower().encode(), v if isinstance(v, bytes) else v.encode()) for k, v in (headers or {}).items()],
             "query_string": b"", "root_path": ""}
    asyncio.run(middleware(scope, receive, send))
    start = next((m for m in sent if m["type"] == "http.response.start"), {})
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start.get("status"), json.loads(content) if content else {}, sent, read


API = {"Authorization": "Bearer api-secret"}


@pytest.mark.parametrize("path", ["/invocations", "/generative_scoring", "/v1/completions", "/inference/v1/generate",
                                  "/pooling", "/some/future/route"])
def test_every_route_but_the_open_ones_is_generation(path):
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
        assert call(weights, "/invocations", {"Authorization": odd})[0] == 401
    no_token = FakeWeights(admin_token=None)  # then only loopback clients; this one is 10.0.0.2
    assert call(no_token, "/policy_step", method="GET")[:2] == (
        403, {"detail": "admin routes answer loopback clients only when no admin token is set"})


@pytest.mark.parametrize("path", ["/scale_elastic_ep", "/v1/load_lora_adapter", "/collective_rpc", "/pause"])
def test_vllm_control_routes_are_refused_even_with_the_key(path):
    weights = FakeWeights()
    status, body, _, _ = call(weights, path, API)
    assert status == 403 and "rl changes weights only through /update_weights" in body["detail"]
    assert weights.seen_in_flight == []


def test_websockets_are_refused():
    _, _, sent, _ = call(FakeWeights(), "/v1/realtime", API, scope_type="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "this server answers HTTP only"}]
