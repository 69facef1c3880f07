"""vLLM's bootstrap: `serve()` runs vLLM's own OpenAI-compatible server until it is stopped, adding rl's parts
through vLLM's public hooks only (`vllm_argv`): the worker extension that reloads and verifies the served weights
in place (`rl.inference.worker`), the ASGI gate in front of vLLM's app (`rl.inference.gate`), and the policy state
the gate serves (`AdminSettings`, carried to the gate on vLLM's args namespace). On CPU hosts it also sets
`RL_VLLM_SHM_POLL_S`, which our vLLM plugin (`rl/patches.py`) reads in each vLLM process: vLLM's inter-process
queues then sleep between polls instead of spinning. The entrypoint is `python -m rl.inference.main @ infer.toml`.
"""

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from rl import patches
from rl.inference.config import LoraServingConfig
from rl.inference.gate import AdminMiddleware
from rl.inference.policy import AdminSettings

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "rl.inference.worker.WeightSyncExtension"  # named, not imported: the worker module needs torch
MIDDLEWARE = f"{AdminMiddleware.__module__}.{AdminMiddleware.__qualname__}"
# On SIGTERM vLLM stops its engine first, so a request still open cannot finish (an update awaiting the
# engine's reply would wait forever), and uvicorn by default waits for every open request.
SHUTDOWN_GRACE_S = 5
# Idle keep-alive on the server side; longer than clients' (httpx: 5 s, the orchestrator's aiohttp: 15 s).
KEEP_ALIVE_S = 75
SOCKET_PATH_MAX = 107  # a unix socket's path in bytes (sockaddr_un.sun_path, less its NUL)
UUID_CHARS = 36  # vLLM names each socket by a uuid4


def vllm_argv(model: str, host: str, port: int, dtype: str, max_model_len: int, enforce_eager: bool, seed: int,
              gpu_memory_utilization: float, tensor_parallel_size: int, served_model_name: str | None,
              extra_args: list[str], lora: LoraServingConfig | None = None) -> list[str]:
    """vLLM's command line for our server; `extra_args` come last, so they can override."""
    argv = [
        "--model", model, "--host", host, "--port", str(port), "--dtype", dtype,
        "--max-model-len", str(max_model_len), "--seed", str(seed),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--enable-scale-out",  # vLLM serves /inference/v1/generate only with it
        # logprobs of the distribution actually sampled from, which importance ratios at temperature != 1 need
        "--logprobs-mode", "processed_logprobs",
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
