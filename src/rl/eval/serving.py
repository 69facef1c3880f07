"""The server `eval` samples from: one it starts (rl's inference server, with a LoRA adapter loaded through its
update route) or any OpenAI-compatible server at a base URL, and the waits until either serves."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import httpx

from rl import health
from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, next_vllm_rank
from rl.config import ConfigError, url_without_password, write_config
from rl.eval.config import EvalCommandConfig
from rl.inference.config import LoraServingConfig, client_host
from rl.launcher.supervisor import ChildSpec, Supervisor
from rl.manifest import mark_stable
from rl.config import API_KEY_VAR
from rl.protocol import STABLE, CorruptFileError, RunPaths, verify_stable

ADAPTER_LOAD_TIMEOUT_S = 600  # a load holds generation; the server's own bound on an update is the same order
POLL_REQUEST_TIMEOUT_S = 10


class EvalError(RuntimeError):
    """Eval cannot go on or produced nothing; the message names the server and model and says why."""


def check_weights(model: str) -> None:
    """A run's `weights/step_k` carries a STABLE marker: refuse files that were truncated or changed."""
    path = Path(model)
    if (path / STABLE).is_file():
        try:
            verify_stable(path)
        except CorruptFileError as e:
            raise ConfigError(f"model {model}: {e}") from None


def check_adapter(adapter: Path) -> int:
    """A PEFT adapter directory (its files verified against a run's STABLE marker when it has one); its rank."""
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (adapter / name).is_file()]
    if missing:
        raise ConfigError(f"adapter {adapter} is not a LoRA adapter directory: it lacks {', '.join(missing)}")
    check_weights(str(adapter))
    try:
        return int(json.loads((adapter / ADAPTER_CONFIG).read_text())["r"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"adapter {adapter}: {ADAPTER_CONFIG} has no integer rank 'r' ({e!r})") from None


def stage_adapter(adapter: Path, out: Path) -> Path:
    """The adapter copied as step 1 of eval's own weights dir, marked STABLE: the server loads it through its update
    route and verifies what it serves, as in a run (any PEFT directory, not only a run's step)."""
    step = out / "adapter" / "step_1"
    step.mkdir(parents=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(adapter / name, step / name)
    mark_stable(step)
    return step


def load_adapter(url: str, step: Path) -> dict:
    response = httpx.post(f"{url}/update_weights", json={"step": 1, "path": step.name}, timeout=ADAPTER_LOAD_TIMEOUT_S)
    if response.status_code != 200:
        raise EvalError(f"the server refused the adapter {step}: {response.status_code} {response.text}")
    return response.json()


def start_server(config: EvalCommandConfig, out: Path) -> tuple[Supervisor, str]:
    """rl's inference server for the model (with LoRA on for an adapter), logging to <out>/logs/inference.log."""
    inference = config.inference.model_copy(update={"model": config.model})
    if config.adapter is not None:
        lora = LoraServingConfig(max_rank=next_vllm_rank(check_adapter(config.adapter)))
        inference = inference.model_copy(update={"lora": lora, "weights_dir": (out / "adapter").absolute()})
    write_config(inference, out / "configs" / "inference.toml")
    cmd = [sys.executable, "-m", "rl.inference.main", "@", str((out / "configs" / "inference.toml").absolute())]
    supervisor = Supervisor(RunPaths(out), tail_lines=40, shutdown_timeout_s=10)
    supervisor.start(ChildSpec("inference", cmd, None, out / "logs" / "inference.log"))
    return supervisor, f"http://{client_host(inference.host)}:{inference.port}"


def wait_for_own_server(url: str, timeout_s: float, supervisor: Supervisor) -> None:
    """Until the server eval started answers /health; at once if it has exited (its code and log's tail)."""
    def exited() -> str | None:
        code = supervisor.exit_code("inference")
        if code is None:
            return None
        tail = "\n".join(supervisor.log_tail("inference", 30))
        return (f"the inference server exited with code {code} before it was healthy; "
                f"{supervisor.log('inference')}:\n{tail}")

    async def wait() -> None:
        async with httpx.AsyncClient() as http:
            await health.wait_healthy(http, [url], timeout_s, exited)

    try:
        asyncio.run(wait())
    except (RuntimeError, TimeoutError) as e:
        raise EvalError(str(e)) from None


def api_key(var: str) -> str:
    return os.environ.get(var) or "EMPTY"


def check_api_key_var(var: str) -> None:
    """A variable the user named must hold a key; only rl's own variable may be unset (servers without keys)."""
    if var != API_KEY_VAR and not os.environ.get(var):
        raise ConfigError(f"client.api_key_var = {var!r}, but the environment variable {var} is not set: export the "
                          "server's API key in it")


def wait_for_models(api_root: str, key_var: str, timeout_s: float) -> list[str] | None:
    """Poll <api_root>/models (any OpenAI-compatible server has it; a hosted API has no /health) until it answers;
    the model ids it serves, or None where it lists none (404). A refused key fails at once."""
    shown = url_without_password(api_root)  # for messages: no password
    last = "no answer"
    headers = {"Authorization": f"Bearer {api_key(key_var)}"}

    async def listed(http: httpx.AsyncClient) -> tuple[list[str] | None] | None:
        nonlocal last
        try:
            response = await http.get(f"{api_root}/models", headers=headers, timeout=POLL_REQUEST_TIMEOUT_S)
        except httpx.HTTPError as e:
            last = repr(e)
            return None
        if response.status_code in (401, 403):
            raise EvalError(f"server {shown} refused the API key in ${key_var} ({response.status_code}: "
                            f"{response.text[:300]}); set client.api_key_var to the variable holding its key")
        if response.status_code in (200, 404):
            return (model_ids(api_root, response) if response.status_code == 200 else None,)
        last = f"{response.status_code}: {response.text[:300]}"
        return None

    async def wait() -> list[str] | None:
        async with httpx.AsyncClient() as http:
            return (await health.wait_ready(lambda: listed(http), timeout_s, lambda: f"GET {shown}/models"))[0]

    try:
        return asyncio.run(wait())
    except TimeoutError:
        raise EvalError(f"server {shown} did not answer GET /models within {timeout_s:.0f}s (last: {last}); "
                        "is client.base_url right and the server up?") from None


def model_ids(api_root: str, response: httpx.Response) -> list[str]:
    shown = url_without_password(api_root)  # for messages: no password
    try:
        return [model["id"] for model in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise EvalError(f"server {shown}: GET /models did not answer an OpenAI model list ({e!r}): "
                        f"{response.text[:300]}") from None


def check_served(api_root: str, model: str, served: list[str] | None, logger) -> None:
    shown = url_without_password(api_root)  # for messages: no password
    if served is None:
        logger.warning(f"server {shown} lists no models (GET /models: 404); model {model!r} is not checked")
    elif model not in served:
        raise EvalError(f"server {shown} does not serve model {model!r}; it serves {', '.join(served[:20])}. "
                        "Set client.served_model (or model.name) to one of them")
