"""`eval` on a plain vLLM OpenAI server (`vllm.entrypoints.openai.api_server`, none of rl's routes), serving the
tiny model under another name behind an API key: sampled through chat completions, every rollout scored and
written."""

import json
import os
import subprocess
import sys

import pytest

from rl.inference.main import cpu_vllm_args
from tests.conftest import ROOT
from tests.integration.inference_server import wait_serving
from tests.integration.launched import KV_CACHE_GIB, free_port

pytestmark = pytest.mark.integration
API_KEY = "plain-vllm-test-key"
SERVED = "tiny-chat"
MAX_MODEL_LEN = 512


@pytest.fixture
def plain_vllm(tiny_model, tmp_path):
    """vLLM as a user starts it (the CPU settings rl's server uses as well); its API root."""
    port = free_port()
    log = tmp_path / "vllm.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
        "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
        "--kv-cache-memory-bytes", str(int(float(KV_CACHE_GIB) * 2**30)), "--api-key", API_KEY,
        *cpu_vllm_args(MAX_MODEL_LEN),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_serving(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_eval_on_a_plain_vllm_server_through_chat_completions(tiny_model, tmp_path, plain_vllm):
    out = tmp_path / "eval"
    envs = [{"id": "reverse-text", "args": {"num_examples": 20}}]
    cmd = [
        sys.executable, "-m", "rl.eval.main", "--model.name", str(tiny_model), "--client.base-url", plain_vllm,
        "--client.served-model", SERVED, "--client.api-key-var", "PLAIN_VLLM_KEY", "--env", json.dumps(envs),
        "--num-examples", "3", "--rollouts-per-example", "2", "--sampling.temperature", "1.0",
        "--sampling.max-tokens", "8", "--sampling.seed", "1", "--pass-threshold", "0.5", "--output-dir", str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PLAIN_VLLM_KEY": API_KEY})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 6 and summary["api"] == "chat"
    for r in records:
        assert r["prompt"][-1]["role"] == "user" and r["completion"][0]["role"] == "assistant"
        assert 0 < r["completion_tokens"] <= 8 and 0.0 <= r["reward"] <= 1.0 and "exact_match" in r["metrics"]
    env = summary["envs"]["reverse-text"]
    assert (env["tasks"], env["rollouts"], env["dropped"]) == (3, 6, 0)
    assert env["reward"] == pytest.approx(sum(r["reward"] for r in records) / 6)
    assert env["pass@1"] == pytest.approx(sum(r["passed"] for r in records) / 6) and "avg@2" in env
    assert "reverse-text" in done.stdout  # the table
