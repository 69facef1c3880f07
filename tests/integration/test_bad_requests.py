"""Bad requests to a real inference server (tiny model, an API key and an admin token set), as an attacker or
a careless client would send them: each is answered with a 4xx JSON error naming the problem, nothing
outside the weights dir is read, and the server keeps serving the weights it verified. The rest of the
bad-input suite (configs, files, batches, checkpoints) is tests/unit/test_bad_input.py."""

import json
import shutil
import socket
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from rl.inference.fingerprint import probe_inputs
from rl.protocol import STABLE, mark_stable
from tests.integration.inference_server import Server, model_and_weights_dir

pytestmark = pytest.mark.integration
API_KEY = "api-key-for-tests"
WITH_KEY = {"Authorization": f"Bearer {API_KEY}"}
# Dev mode and runtime LoRA on: their routes exist, and must be refused all the same.
SERVER_ENV = {"VLLM_API_KEY": API_KEY, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return model_and_weights_dir(tmp_path_factory, "bad-requests")


@pytest.fixture(scope="module")
def server(run_dir):
    server = Server(run_dir / "model", run_dir / "weights", run_dir / "inference.log", env=SERVER_ENV)
    yield server
    server.stop()


def step_dir(run_dir, step: int, change=None):
    """weights/step_k: the model with lm_head written, `change(state)` applied, marked STABLE."""
    out = run_dir / "weights" / f"step_{step}"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(run_dir / "model", out)
    state = load_file(out / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    if change:
        change(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    mark_stable(out)
    return out


def update(server, step, path, **kwargs) -> httpx.Response:
    return server.admin("POST", "/update_weights", json={"step": step, "path": str(path)}, **kwargs)


def served_step(server) -> int:
    return server.admin("GET", "/policy_step").json()["step"]


def assert_refused(response: httpx.Response, status: int, named: str):
    assert response.status_code == status, (response.status_code, response.text)
    assert named in response.json()["detail"], response.text


# ---- routes: an allow-list, on the route vLLM's router matches ----

GENERATION = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
]


@pytest.mark.parametrize("path, body", GENERATION, ids=[p for p, _ in GENERATION])
def test_every_generation_route_needs_the_api_key(server, path, body):
    response = httpx.post(f"{server.url}{path}", json={"model": str(server.model)} | body, timeout=60)
    assert response.status_code == 401, (path, response.text)


# vLLM routes that change the engine's state or serve APIs rl does not use (several exist only in dev mode or
# with runtime LoRA, both on for these servers), and a route no vLLM has yet: none is on the allow-list.
REFUSED = ["/inference/v1/abort_requests", "/pause", "/collective_rpc", "/weight_checker", "/scale_elastic_ep",
           "/v1/load_lora_adapter", "/reset_prefix_cache", "/invocations", "/generative_scoring", "/tokenize",
           "/no/such/route"]


@pytest.mark.parametrize("path", REFUSED)
def test_routes_off_the_allow_list_are_403_even_with_the_api_key(server, path):
    body = {"model": str(server.model), "request_ids": ["someone-elses"], "action": "reset", "prompt": "hi",
            "method": "reset_weights", "lora_name": "x", "lora_path": "/tmp"}
    assert_refused(httpx.post(f"{server.url}{path}", json=body, headers=WITH_KEY, timeout=30), 403, "is not served")
    assert_refused(httpx.get(f"{server.url}{path}", headers=WITH_KEY, timeout=30), 403, "is not served")
    assert generates(server.url)  # nothing paused, reset or aborted the engine


def generates(url: str) -> bool:
    body = {"prompt": "still there", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=WITH_KEY, timeout=60).status_code == 200


def raw_request(server, method: bytes, target: bytes, headers: bytes = b"", body: bytes = b"") -> tuple[int, bytes]:
    """One request sent byte for byte (httpx would normalise the path); the status and body answered."""
    head = (method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(head + body)
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), content


# Spellings a normalising server might read as another route: refused as they are, never guessed at.
NOT_PLAIN = [b"//v1/models", b"/v1/models/", b"/v1//models", b"/v1%2Fmodels", b"/v1/../pause", b"/v1/%2e%2e/pause",
             b"/./pause", b"/pause%00", b"/%ED%A0%80", b"/v1/mod%C3%A9ls"]


@pytest.mark.parametrize("target", NOT_PLAIN, ids=lambda t: t.decode())
def test_paths_not_in_plain_form_are_400(server, target):
    status, content = raw_request(server, b"POST", target, b"Authorization: Bearer " + API_KEY.encode() + b"\r\n")
    assert status == 400, (status, content)
    detail = json.loads(content)["detail"]
    assert "is not a plain route" in detail or "is percent-encoded" in detail


def test_a_path_component_over_255_bytes_is_a_4xx_not_a_500(server):
    status, content = raw_request(server, b"GET", b"/" + b"a" * 300 + b"/" + b"b" * 5000)
    assert status == 403 and "is not served" in json.loads(content)["detail"]


def test_completions_are_counted_in_flight(server):
    """/v1/completions generates: an update must see it in flight."""
    body = {"model": str(server.model), "prompt": "count", "max_tokens": 400, "min_tokens": 400, "temperature": 1.0}
    done = []
    thread = threading.Thread(target=lambda: done.append(httpx.post(
        f"{server.url}/v1/completions", json=body, headers=WITH_KEY, timeout=120)))
    thread.start()
    seen, deadline = 0, time.monotonic() + 60
    while thread.is_alive() and time.monotonic() < deadline and not seen:
        seen = server.admin("GET", "/policy_step").json()["requests_in_flight"]
        time.sleep(0.02)
    thread.join(120)
    assert done and done[0].status_code == 200, done and done[0].text
    assert seen == 1


def test_open_routes_need_no_key(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200


# ---- admin requests ----

def status_before_the_body_is_sent(server, path: str, token: str, content_length: int, sent: int) -> int:
    """POST announcing `content_length` bytes but sending only `sent`: the status the server answers with
    meanwhile (a server that waits for the whole body answers nothing: timeout)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n")
        connection.sendall(head.encode() + b"{" + b" " * (sent - 1))
        return int(connection.recv(4096).split(b" ", 2)[1])


def test_the_body_is_not_read_before_the_caller_is_authorized(server):
    assert status_before_the_body_is_sent(server, "/update_weights", "wrong", 200 << 20, 1024) == 401
    assert status_before_the_body_is_sent(server, "/update_weights", server.token, 200 << 20, 128 << 10) == 413
    assert server.proc.poll() is None


@pytest.mark.parametrize("authorization", ["Bearer t\u00e9st".encode(), b"\xff\xfe", b"Bearer"],
                         ids=["non-ascii", "not-utf8", "empty-token"])
def test_odd_authorization_headers_are_401(server, authorization):
    response = httpx.get(f"{server.url}/policy_step", headers={"Authorization": authorization}, timeout=10)
    assert response.status_code == 401 and response.json() == {"detail": "missing or wrong bearer token"}


def test_a_path_with_a_nul_byte_is_422(server):
    assert update(server, 1, "step_1\x00/../../etc").status_code == 422


def test_a_step_is_bound_to_its_own_directory(server, run_dir):
    step_dir(run_dir, 20)
    assert_refused(update(server, 10, run_dir / "weights" / "step_20"), 400, "step 10 loads only from step_10")
    assert update(server, 10**30, "step_20").status_code == 422  # past int64: no policy version can hold it
    assert served_step(server) == 0


def test_a_file_linking_outside_the_weights_dir_is_never_loaded(server, run_dir):
    step = step_dir(run_dir, 21)
    outside = run_dir / "elsewhere.safetensors"
    shutil.move(step / "model.safetensors", outside)
    (step / "model.safetensors").symlink_to(outside)
    mark_stable(step)
    assert_refused(update(server, 21, step), 403, "outside the weights dir")
    unlisted = step_dir(run_dir, 22)
    (unlisted / "extra.safetensors").symlink_to(outside)  # not in the marker, but the reload reads *.safetensors
    assert_refused(update(server, 22, unlisted), 403, "extra.safetensors links to")
    assert served_step(server) == 0


MARKERS = [
    ("absolute-name", {"files": {"/etc/hostname": {"bytes": 1, "crc32": 1}}}, "outside"),
    ("parent-name", {"files": {"../../inference.log": {"bytes": 1, "crc32": 1}}}, "outside"),
    ("files-not-an-object", {"files": ["model.safetensors"]}, "not an object"),
    ("entry-without-bytes", {"files": {"model.safetensors": {"crc32": 1}}}, "integer `bytes`"),
    ("not-utf8", b"\xff\xfe{}", "not UTF-8"),
    ("marker-is-a-directory", None, "is not a regular file"),
]


@pytest.mark.parametrize("marker, named", [c[1:] for c in MARKERS], ids=[c[0] for c in MARKERS])
def test_a_malformed_marker_is_422(server, run_dir, marker, named):
    step = step_dir(run_dir, 30)
    (step / STABLE).unlink()
    if marker is None:
        (step / STABLE).mkdir()
    else:
        (step / STABLE).write_bytes(marker if isinstance(marker, bytes) else json.dumps(marker).encode())
    response = update(server, 30, step)
    assert_refused(response, 422, named)
    assert "bytes, " not in response.text  # no size of a file outside is disclosed
    assert served_step(server) == 0


def test_a_retried_update_reloads_a_changed_directory_and_checksums_cover_every_weight(server, run_dir):
    name = "model.layers.0.mlp.down_proj.weight"
    first = update(server, 40, step_dir(run_dir, 40))
    assert first.status_code == 200, first.text
    again = update(server, 40, run_dir / "weights" / "step_40")  # a retry of the same request: nothing reloads
    assert again.json() == {"step": 40, "weights_checksum": first.json()["weights_checksum"],
                            "instance": first.json()["instance"]}

    def change_unsampled_column(state):
        weight = state[name]
        cols, _ = probe_inputs(weight.shape[1], torch.float32)
        weight[:, next(j for j in range(weight.shape[1]) if j not in cols)] += 0.25

    changed = update(server, 40, step_dir(run_dir, 40, change_unsampled_column))  # rewritten, same step
    assert changed.status_code == 200, changed.text
    assert "reload_s" in changed.json()  # loaded again, not answered from the first load
    assert changed.json()["weights_checksum"] != first.json()["weights_checksum"]
    assert served_step(server) == 40


# ---- malformed admin requests: a 4xx JSON naming the problem, never a 500 ----

BAD_BODIES = [
    ("inf", b'{"step": 1e400, "path": "step_1"}', "overflows a float"),
    ("nan", b'{"step": NaN, "path": "step_1"}', "not a JSON number"),
    ("lone-surrogate", b'{"step": 1, "path": "step_1\\ud800"}', "lone surrogate"),
    ("deep-nesting", b'{"path": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "nested deeper than"),
    ("long-component", b'{"step": 1, "path": "' + b"a" * 300 + b'"}', "component over 255 bytes"),
    ("many-digits", b'{"step": ' + b"7" * 5000 + b', "path": "step_1"}', "an integer of 5000 digits"),
    ("bool-timeout", b'{"step": 1, "transfer": {"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, '
                     b'"timeout_s": true}}', "timeout_s"),  # not 1 s
]


@pytest.mark.parametrize("body, named", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_a_malformed_update_body_is_422(server, body, named):
    before = served_step(server)
    response = server.admin("POST", "/update_weights", content=body, headers={"Content-Type": "application/json"})
    assert_refused(response, 422, named)
    assert served_step(server) == before


def test_a_path_to_a_file_is_404(server, run_dir):
    step_dir(run_dir, 50)
    assert_refused(update(server, 50, "step_50/config.json"), 404, "no step directory")


def test_a_nul_in_a_header_is_the_http_parsers_400(server):
    """uvicorn's parser refuses it before rl sees the request (docs/architecture.md says so)."""
    for name in (b"Authorization: Bearer test-to\x00ken", b"X-Anything: a\x00b"):
        assert raw_request(server, b"GET", b"/policy_step", name + b"\r\n")[0] == 400
    assert server.proc.poll() is None


# ---- the same rules behind vLLM's --root-path ----

ROOT = "/api"


@pytest.fixture(scope="module")
def rooted(run_dir):
    env = SERVER_ENV | {"RL_INFERENCE__EXTRA_ARGS": json.dumps(["--root-path", ROOT])}
    server = Server(run_dir / "model", run_dir / "weights", run_dir / "inference-rooted.log", env=env)
    yield server
    server.stop()


def test_admin_routes_behind_a_root_path_need_the_token(rooted):
    for path in (f"{ROOT}/update_weights", f"{ROOT}/policy_step"):
        response = httpx.post(f"{rooted.url}{path}", json={"step": 1, "path": "step_1"}, timeout=30)
        assert_refused(response, 401, "missing or wrong bearer token")
    assert rooted.admin("GET", f"{ROOT}/policy_step").json()["step"] == 0
    inf = rooted.admin("POST", f"{ROOT}/update_weights", content=b'{"step": 1e400, "path": "step_1"}')
    assert_refused(inf, 422, "overflows a float")


def test_open_routes_behind_a_root_path(rooted):
    for path in (f"{ROOT}/health", "/health", f"{ROOT}/ping"):
        assert httpx.get(f"{rooted.url}{path}", timeout=10).status_code == 200, path


def test_generation_behind_a_root_path_needs_the_key_and_gets_token_strings(rooted):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 1}}
    url = f"{rooted.url}{ROOT}/inference/v1/generate"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    response = httpx.post(url, json=body, headers=WITH_KEY, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    assert generates(f"{rooted.url}{ROOT}")


@pytest.mark.parametrize("path", [f"{ROOT}/pause", f"{ROOT}/collective_rpc", f"{ROOT}/scale_elastic_ep",
                                  f"{ROOT}/weight_checker", f"{ROOT}/inference/v1/abort_requests",
                                  f"{ROOT}/v1/load_lora_adapter", "/pause", f"{ROOT}{ROOT}/pause"])
def test_control_routes_behind_a_root_path_are_403(rooted, path):
    body = {"method": "reset_weights", "action": "reset", "request_ids": ["x"], "lora_name": "x", "lora_path": "/tmp"}
    assert_refused(httpx.post(f"{rooted.url}{path}", json=body, headers=WITH_KEY, timeout=30), 403, "is not served")
    assert generates(f"{rooted.url}{ROOT}")


def test_unplain_paths_behind_a_root_path_are_400(rooted):
    for target in (f"{ROOT}//pause", f"{ROOT}/v1/../pause", f"{ROOT}/v1%2Fmodels", ROOT):
        status, content = raw_request(rooted, b"POST", target.encode(), b"Authorization: Bearer " + API_KEY.encode()
                                      + b"\r\n")
        assert status == 400, (target, status, content)
