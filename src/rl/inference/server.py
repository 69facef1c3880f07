"""vLLM's bootstrap: `serve()` runs vLLM's own OpenAI-compatible server until it is stopped, adding rl's parts
through vLLM's public hooks only (`vllm_argv`): the worker extension that reloads and verifies the served weights
in place (`rl.inference.worker`), the ASGI gate in front of vLLM's app (`rl.inference.gate`), and the policy state
the gate serves (`AdminSettings`, carried to the gate on vLLM's args namespace). On CPU hosts it also sets
`RL_VLLM_SHM_POLL_S`, which our vLLM plugin (`rl/patches/`) reads in each vLLM process: vLLM's inter-process
queues then sleep between polls instead of spinning. The entrypoint is `python -m rl.inference.main @ infer.toml`.
"""

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from rl import patches
from rl.config import is_hybrid, is_moe
from rl.inference import cpu_fork
from rl.inference.config import InferenceConfig
from rl.inference.gate import AdminMiddleware, AnsweredGenerationFilter
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


def vllm_argv(config: InferenceConfig, model_dir: str, memory_share: float, host_args: list[str]) -> list[str]:
    """vLLM's command line for our server; `host_args`, then the user's `config.extra_args`, come last, so they
    can override."""
    argv = [
        "--model", model_dir, "--served-model-name", config.model.name,
        "--host", config.host, "--port", str(config.port), "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len), "--seed", str(config.seed),
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--gpu-memory-utilization", str(memory_share),
        "--enable-scale-out",  # vLLM serves /inference/v1/generate only with it
        # logprobs of the distribution actually sampled from, which importance ratios at temperature != 1 need
        "--logprobs-mode", "processed_logprobs",
        # requests carry their group's number under continuous dispatch: the episodes started first are served
        # first and preempted last, so long ones are not starved by newer short ones (orchestrator/dispatch.py)
        "--scheduling-policy", "priority",
        "--worker-extension-cls", WORKER_EXTENSION, "--middleware", MIDDLEWARE,
    ]
    argv += ["--enforce-eager"] if config.enforce_eager else []
    argv += routed_experts_args(model_dir) if config.records_experts else []
    argv += hybrid_args(model_dir)
    argv += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gib * 2**30))] if config.kv_cache_gib else []
    argv += ["--disable-log-stats"] if config.log_stats is False else []
    # Parsed in this process (never a command line others can read); vLLM's log of its args hides it.
    argv += ["--api-key", config.api_key] if config.api_key else []
    # One adapter slot: the policy's adapter, replaced in place at every step.
    argv += ["--enable-lora", "--max-lora-rank", str(config.lora.max_rank), "--max-loras", "1"] if config.lora else []
    return argv + host_args + config.extra_args


def routed_experts_args(model_dir: str) -> list[str]:
    """An MoE's routed experts in every generation's reply; on CPU with prefix caching off (rl's recorder there,
    `patches.capture_routed_experts_on_cpu`, computes every token it reports)."""
    if not is_moe(model_dir):
        return []
    return ["--enable-return-routed-experts"] + (["--no-enable-prefix-caching"] if on_cpu() else [])


def hybrid_args(model_dir: str) -> list[str]:
    """A hybrid model (linear-attention layers, a recurrent state per sequence) is served without prefix caching
    on CPU: vLLM caches a hybrid model's prefixes only by keeping the recurrent state at block boundaries (its mamba
    cache mode "align"), which needs chunked prefill, and rl turns chunked prefill off on CPU
    (`rl.inference.main.cpu_vllm_args`). On GPUs vLLM's defaults stand. Either way a sequence in flight keeps its
    state across a weight update as it keeps its KV (`inference.prefix_cache_on_update`: "salt" keeps both, "reset"
    recomputes both under the new weights)."""
    return ["--no-enable-prefix-caching"] if is_hybrid(model_dir) and on_cpu() else []


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_lora_name(config: InferenceConfig, model_dir: str) -> None:
    """vLLM refuses an adapter named like a served base model, but only when it is first loaded: refuse at start-up."""
    lora, served = config.lora, config.model.name
    if lora is not None and lora.name in (model_dir, served):
        raise ValueError(f"inference.lora.name {lora.name!r} is the served model's name {served!r} (model "
                         f"{model_dir!r}): vLLM refuses an adapter named like its base model; "
                         "choose another adapter name")


def _log_to_stderr() -> None:
    """Our INFO lines in the server's log, beside vLLM's (vLLM configures only its own loggers)."""
    package = logging.getLogger("rl")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("(rl) %(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
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


def serve(config: InferenceConfig, model_dir: str, memory_share: float, host_args: list[str]) -> None:
    """Run vLLM's OpenAI-compatible server with rl's parts until it is stopped.

    `config` has its device defaults resolved (`resolve_device_defaults`). `model_dir` holds the model's files, which
    the served weights are verified against (`config.model.name`, the name requests use, may be a hub id);
    `memory_share` is the share of GPU memory (on CPU: of the NUMA node) vLLM reserves; `host_args` are the vLLM
    arguments this host needs, given before the user's `config.extra_args`.
    """
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server

    if not Path(model_dir).is_dir():
        raise ValueError(f"model {model_dir!r} must be a local Hugging Face directory (its files are verified)")
    patches.check_internals("inference", "cpu" if on_cpu() else "cuda")  # before vLLM starts: what rl reads is there
    check_lora_name(config, model_dir)
    forks = cpu_start_method()  # before vLLM's own set-up, which sets spawn where nothing is set
    if is_moe(model_dir) and on_cpu():  # here, and in every process vLLM starts (forked or spawned), by its plugin
        os.environ[patches.MOE_ENV] = "record" if config.records_experts else "reload"
        patches.vllm_cpu_moe()
    if is_hybrid(model_dir) and on_cpu():  # vLLM's CPU kernels for linear attention take bf16 only
        os.environ[patches.GDN_ENV] = "1"
        patches.gdn_float32_on_cpu()
    args = parsed_vllm_args(vllm_argv(config, model_dir, memory_share, host_args))
    args.rl_admin = AdminSettings(  # what the gate and the policy it serves read
        base_model=model_dir, weights_dir=str(config.weights_dir) if config.weights_dir else None,
        admin_token=config.admin_token, api_keys=api_keys(args), lora_name=config.lora.name if config.lora else None,
        engine=config.transfer.engine, transfer_key=config.transfer.key(),
        salt_per_policy=config.prefix_cache_on_update == "salt",
    )
    if forks:
        logger.info("vLLM's engine core and workers start by fork on CPU (%s was unset)", patches.START_METHOD_ENV)
    set_shm_poll()
    if not config.log_generation_requests:  # a filter of the logger itself: uvicorn's logging setup keeps it
        logging.getLogger("uvicorn.access").addFilter(AnsweredGenerationFilter())
    with private_ipc_dir(), cpu_compile_policy(args.enforce_eager):
        uvloop.run(run_server(args, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))


def cpu_start_method() -> bool:
    """On CPU hosts vLLM's engine core and workers start by fork (`patches.vllm_cpu_fork`), unless
    VLLM_WORKER_MULTIPROC_METHOD names another method: the user's choice is kept (vLLM's CPU platform would set spawn
    over a user's fork). Whether fork was chosen."""
    if not on_cpu() or os.environ.get(patches.START_METHOD_ENV, "fork") != "fork":
        return False
    patches.vllm_cpu_fork(cpu_fork.child)
    return True


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
COMPILE_OFF = "TORCH_COMPILE_DISABLE"  # read by torch._dynamo when a spawned vLLM process imports torch


@contextlib.contextmanager
def cpu_compile_policy(enforce_eager: bool):
    """What torch.compile does in a CPU server's vLLM processes (GPU hosts: nothing changes).

    With `--enforce-eager` (the CPU default) vLLM still torch.compiles a few helpers: the sampler's count of each
    sampled token's rank, which every request with logprobs runs, and with tensor parallelism the vocab-parallel
    embedding's mask. On CPU inductor builds them with gcc at a server's first request: 10-12 s before the first
    token, measured on a 2-core host, for kernels whose eager form costs nothing at these sizes. So eager means
    eager: TORCH_COMPILE_DISABLE=1 in the processes vLLM spawns, unless the environment sets it already, and
    torch._dynamo's switch itself in this process, which the processes it forks inherit (torch, imported already,
    reads the variable only at its import). A CPU server that compiles (enforce_eager false) compiles into a cache
    of its own (`private_compile_cache`)."""
    if not on_cpu():
        yield
    elif not enforce_eager:
        with private_compile_cache():
            yield
    elif COMPILE_OFF in os.environ:
        yield
    else:
        import torch._dynamo.config

        os.environ[COMPILE_OFF] = "1"
        logger.info("enforce-eager on CPU: torch.compile is off in vLLM's processes (%s=1)", COMPILE_OFF)
        try:
            with torch._dynamo.config.patch(disable=True):
                yield
        finally:
            del os.environ[COMPILE_OFF]


@contextlib.contextmanager
def private_compile_cache():
    """A torch inductor cache of this CPU server's own, removed when it ends. Inductor compiles a kernel straight
    to its final path in the shared cache, then trusts any file there: a server killed while compiling left a
    truncated `.so` that failed every later server on the host ("file too short"; seen when the fault test killed
    a TP server). The cost is each compile at each server's start. A cache directory the user chose is kept
    (torch writes its default into the environment when imported, so only another value counts as chosen)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE, default_cache_dir())
    if os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        yield
        return
    path = tempfile.mkdtemp(prefix="rl-inductor-")
    os.environ[INDUCTOR_CACHE] = path
    try:
        yield
    finally:
        os.environ[INDUCTOR_CACHE] = chosen
        shutil.rmtree(path, ignore_errors=True)


def parsed_vllm_args(argv: list[str]):
    """vLLM's args namespace for `argv`, parsed and validated as `vllm serve` does, with logging set up."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    # Clients (httpx) drop an idle keep-alive connection after 5 s; a server that closes at the same
    # 5 s can close one just as a request is sent on it ("Connection error" under CPU load). Closing
    # later than any client leaves the decision to the client.
    os.environ.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(KEEP_ALIVE_S))
    args = make_arg_parser(FlexibleArgumentParser(prog="rl.inference.server")).parse_args(argv)
    configure_logging_from_args(args)
    _log_to_stderr()
    validate_parsed_serve_args(args)
    return args


def api_keys(args) -> tuple[str, ...]:
    """The API keys vLLM requires on generation routes, read as vLLM reads them (--api-key, else VLLM_API_KEY)."""
    from vllm import envs as vllm_envs

    return tuple(key for key in (args.api_key or [vllm_envs.VLLM_API_KEY]) if key)


def set_shm_poll() -> None:
    """On CPU hosts, let vLLM's shared-memory queues sleep between polls (see `rl.patches`). The plugin that does it
    runs in each process vLLM starts, but only once per process, and this one may have run it before the variable
    was set: it is applied here too, so that the engine core and workers forked from this process inherit it."""
    if on_cpu():
        os.environ.setdefault(patches.POLL_ENV, str(patches.CPU_POLL_S))
    poll_s = patches.poll_interval()  # a bad value fails here, before vLLM starts its processes
    if poll_s is not None:
        patches.vllm_shm_polling()
        logger.info("vLLM's shared-memory queues sleep %s s per poll (%s)", poll_s, patches.POLL_ENV)
