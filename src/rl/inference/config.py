"""Inference server configuration (one vLLM server per data-parallel replica)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rl.config import ModelConfig, Settings

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
"""Addresses only this host reaches: a server bound to one is private to the host, and without an admin
token the admin routes answer only clients connecting from one."""


class InferenceConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_INFERENCE__")

    model: ModelConfig = ModelConfig()
    host: Annotated[str, Field(description="bind address; admin routes are reachable by anyone who can connect")] = (
        "127.0.0.1"
    )
    port: Annotated[int, Field(ge=1, le=65535, description="port of the first replica; replica i uses port + i")] = 8000
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16", "auto"], Field(description="weights dtype (float32 on CPU hosts)")
    ] = "float32"
    max_model_len: Annotated[int, Field(ge=16, description="longest sequence the server accepts")] = 2048
    tensor_parallel_size: Annotated[
        int, Field(ge=1, le=1, description="GPUs per replica: 1 (weight verification reads unsharded layers); "
                                           "use more replicas instead")
    ] = 1
    gpu_memory_utilization: Annotated[
        float | None,
        Field(gt=0, le=1, description="share of GPU memory vLLM may use (CPU: of the NUMA node); unset: 0.9 GPU, 0.2 CPU"),
    ] = None
    enforce_eager: Annotated[bool, Field(description="skip graph capture (faster start-up; on CPU always)")] = True
    seed: Annotated[int, Field(description="vLLM sampling seed")] = 0
    weights_dir: Annotated[
        Path | None, Field(description="only weights inside this directory may be loaded by /update_weights")
    ] = None
    admin_token: Annotated[
        str | None, Field(min_length=1, description="bearer token required by the admin routes")
    ] = None
    extra_args: Annotated[list[str], Field(description="any other vLLM server arguments, passed through")] = []
