"""A real inference server (`python -m rl.inference.main`) for tests, started once per module."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx

from rl import health
from tests.conftest import ROOT
from tests.integration.launched import KV_CACHE_GIB, STARTED, free_port, stop_process


def model_and_weights_dir(tmp_path_factory, name: str) -> Path:
    """A directory holding the tiny model (`model/`) and an empty weights dir (`weights/`)."""
    from rl.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp(name)
    build_tiny_model(root / "model")
    (root / "weights").mkdir()
    return root


class Server:
    """`toml`: extra InferenceConfig settings, passed as a config file (`@ file`) beside the log; `port`: a given one
    (a server restarted where the last one was), else a free one."""

    def __init__(self, model: Path, weights_dir: Path, log: Path, token: str = "test-token", timeout_s: float = 300,
                 env: dict[str, str] | None = None, toml: str | None = None, max_model_len: int = 512,
                 port: int | None = None, host: str = "127.0.0.1", prefix: list[str] | None = None,
                 kv_cache_gib: float = float(KV_CACHE_GIB)):
        """`prefix`: argv the server runs under (another network namespace: `ip netns exec ...`), where it binds to
        `host`."""
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.token = token
        self.model = model
        self.log = log
        cmd = [
            sys.executable, "-m", "rl.inference.main", "--model.name", str(model), "--port", str(self.port),
            "--weights-dir", str(weights_dir), "--admin-token", token, "--max-model-len", str(max_model_len),
            "--kv-cache-gib", str(kv_cache_gib),
            *(["--host", host] if host != "127.0.0.1" else []),
        ]
        if toml is not None:
            config = log.with_suffix(".toml")
            config.write_text(toml)
            cmd[3:3] = ["@", str(config)]
        self.http = httpx.Client(timeout=120)  # one connection kept open, as the orchestrator's client does
        self.proc = subprocess.Popen([*(prefix or []), *cmd], cwd=ROOT, stdout=open(log, "wb"),
                                     stderr=subprocess.STDOUT,
                                     env=os.environ | (env or {}))
        STARTED.add(self)
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        try:
            wait_serving(self.url, self.proc, self.log, timeout_s)
        except TimeoutError:
            self.stop()
            raise

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} | kwargs.pop("headers", {})
        return self.http.request(method, f"{self.url}{path}", headers=headers, **kwargs)

    def generate(self, token_ids: list[int], max_tokens: int = 8, seed: int = 0, temperature: float = 1.0,
                 model: str | None = None) -> tuple[list[int], list[float]]:
        """Token ids and logprobs of a completion; `model`: the model or adapter name
        (the base model's path if None)."""
        body = {
            "model": model or str(self.model),
            "token_ids": token_ids,
            "sampling_params": {"max_tokens": max_tokens, "temperature": temperature, "logprobs": 1, "seed": seed},
        }
        response = httpx.post(f"{self.url}/inference/v1/generate", json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return choice["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)


def wait_serving(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    """Until a vLLM server (rl's or plain) answers /health (rl's own wait, `rl.health.wait_healthy`); at once if
    its process exited. Either failure carries the log's tail."""
    def exited() -> str | None:
        return None if proc.poll() is None else f"the server exited:\n{log.read_text()[-3000:]}"

    async def wait() -> None:
        async with httpx.AsyncClient() as http:
            await health.wait_healthy(http, [url], timeout_s, exited)

    try:
        asyncio.run(wait())
    except TimeoutError as error:
        raise TimeoutError(f"{error}:\n{log.read_text()[-3000:]}") from None
