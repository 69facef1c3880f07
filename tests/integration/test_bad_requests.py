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

from rl.inference.worker import probe_inputs
from rl.protocol import STABLE, mark_stable
from tests.integration.inference_server import Server, model_and_weights_dir

pytestmark = pytest.mark.integration
API_KEY = "api-key-for-tests"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return model_and_weights_dir(tmp_path_factory, "bad-requests")


@pytest.fixture(scope="module")
def server(run_dir):
    server = Server(run_dir / "model", run_dir / "weights", run_dir / "inference.log", env={"VLLM_API_KEY": API_KEY})
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


# ---- generation routes: every one is authenticated, held, counted and refused alike ----

GENERATION = [
    ("/invocations", {"prompt": "hi", "max_tokens": 2}),
    ("/generative_scoring", {"prompt": "hi", "items": ["a"]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
    ("/no/such/route", {}),
]


@pytest.mark.parametrize("path, body", GENERATION, ids=[p for p, _ in GENERATION])
def test_every_generation_route_needs_the_api_key(server, path, body):
    response = httpx.post(f"{server.url}{path}", json={"model": str(server.model)} | body, timeout=60)
    assert response.status_code == 401, (path, response.text)


def test_invocations_are_counted_in_flight(server):
    """/invocations generates: an update must see it in flight (it was invisible to the server's count)."""
    body = {"model": str(server.model), "prompt": "count", "max_tokens": 400, "min_tokens": 400, "temperature": 1.0}
    done = []
    thread = threading.Thread(target=lambda: done.append(httpx.post(
        f"{server.url}/invocations", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)))
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
    ("entry-without-bytes", {"files": {"model.safetensors": {"crc32": 1}}}, "lacks an integer `bytes`"),
    ("not-utf8", b"\xff\xfe{}", "not UTF-8"),
    ("marker-is-a-directory", None, "is not a file"),
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
    assert again.json() == {"step": 40, "weights_checksum": first.json()["weights_checksum"]}

    def change_unsampled_column(state):
        weight = state[name]
        cols, _ = probe_inputs(weight.shape[1], torch.float32)
        weight[:, next(j for j in range(weight.shape[1]) if j not in cols)] += 0.25

    changed = update(server, 40, step_dir(run_dir, 40, change_unsampled_column))  # rewritten, same step
    assert changed.status_code == 200, changed.text
    assert "reload_s" in changed.json()  # loaded again, not answered from the first load
    assert changed.json()["weights_checksum"] != first.json()["weights_checksum"]
    assert served_step(server) == 40
