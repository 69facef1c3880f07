"""Every name rl reads or replaces that another library does not document as public, listed once: `INTERNALS`, with
the version each was read from (`READ_FROM`). docs/architecture.md shows this table (`python -m rl.patches.internals`
prints it; a test keeps the two the same).

Each process checks its rows when it starts (`check_internals`): the inference server vLLM's and what vLLM's processes
read of torch and transformers, the trainer torch's and transformers', a process that runs or sends episodes
verifiers', renderers' and pydantic's. A name that is gone fails the start, naming every missing one and the
installed version, not the first generation or step that would read it. A member counts as there when the owner has
it, declares it as a field, or sets or reads it in one of its methods (an instance's attribute, made in `__init__`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from rl.patches.targets import PatchTargetMissing, installed_version

READ_FROM = {"verifiers": "0.4.0", "vllm": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0",
             "renderers": "0.1.12", "pydantic": "2.14.4"}
PROCESSES = ("inference", "trainer", "episodes")  # episodes: the orchestrator, `eval`, env servers and their workers


@dataclass(frozen=True)
class Internal:
    owner: str  # a dotted path from the library's top module: a module, or a class or object inside one
    members: tuple[str, ...]  # what rl reads or replaces of it; empty: the owner itself
    where: str  # rl's files that read it
    why: str
    device: str = "any"  # "cpu": read only where vLLM serves on CPU (the CPU runner, CPU kernels)

    @property
    def library(self) -> str:
        return self.owner.split(".")[0]

    @property
    def process(self) -> str:
        """The process that reads it: vLLM's library and what vLLM's processes run of others (rl's plugins) are the
        inference server's; torch's and transformers' otherwise the trainer's."""
        if self.library in ("verifiers", "renderers", "pydantic"):
            return "episodes"
        if self.library == "vllm" or "patches/" in self.where or "inference/" in self.where:
            return "inference"
        return "trainer"


INTERNALS = (
    # verifiers: the env server, its pool and client (rl/envs), and what rl's patches replace
    Internal("verifiers.v1.serve.server.EnvServer", ("run", "_handle", "_context", "_running", "_build_task", "_gate",
             "frontend", "env"), "envs/worker_server.py, envs/groups.py",
             "rl's subclass of the env server and a group's episodes run on a worker"),
    Internal("verifiers.v1.serve.pool", ("EnvServer", "_HEALTH", "EnvServerPool"), "patches/verifiers.py",
             "`serve_env_with`, `answer_health_with`"),
    Internal("verifiers.v1.serve.pool.EnvServerPool", ("_mpctx", "workers"), "patches/verifiers.py",
             "`fork_pool_workers`, `pool_workers`"),
    Internal("verifiers.v1.serve.client.EnvClient", ("_pending", "_ensure_receiver", "_send_cancel", "_cancel_tasks",
             "_request", "socket"), "envs/groups.py, envs/seal.py",
             "a group's request sent, cancelled and answered; rl's health reply; the sealed socket"),
    Internal("verifiers.v1.serve.types.RunRequest", ("client",), "patches/verifiers.py", "`serve_rl_client_configs`"),
    Internal("verifiers.v1.configs.agent.WireAgentConfig", ("client",), "patches/verifiers.py",
             "`serve_rl_client_configs` (with `trace.AgentInfo`, `trace.WireTrace`, `episode.WireEpisode` rebuilt)"),
    Internal("verifiers.v1.serve.delta", ("DeltaStreamer", "HEADER_FIELDS", "LIST_FIELDS", "SCALAR_FIELDS", "dump",
             "pack", "unpack"), "patches/verifiers.py, envs/groups.py", "`send_traces_once`; an episode dumped whole"),
    Internal("verifiers.v1.serve.delta.DeltaStreamer", ("watch",), "patches/verifiers.py", "`send_traces_once`"),
    Internal("verifiers.v1.interception.server", ("InterceptionServer", "DIALECTS", "MAX_REQUEST_BODY"),
             "patches/verifiers.py", "`interception_in_process`"),
    Internal("verifiers.v1.interception.server.InterceptionServer", ("start", "_handler_for"), "patches/verifiers.py",
             "`interception_in_process`"),
    Internal("verifiers.v1.clients.train", ("build_async_openai", "RendererSlot"),
             "patches/verifiers.py, patches/renderers.py", "`use_engine_client`, `remembered_on_loop`"),
    Internal("verifiers.v1.clients.train.RendererSlot", ("run", "lock", "renderer"), "patches/renderers.py",
             "`remembered_on_loop`"),
    Internal("verifiers.v1.clients.eval", ("build_async_httpx",), "patches/verifiers.py", "`bound_eval_client`"),
    Internal("verifiers.v1.graph.PendingTurn", ("commit",), "patches/token_versions.py", "`stamp_policy_versions`"),
    Internal("verifiers.v1.runtimes.subprocess", ("CACHE_DIR", "SubprocessRuntime"), "patches/verifiers.py",
             "`lazy_runtime_workdirs`"),
    Internal("verifiers.v1.runtimes.subprocess.SubprocessRuntime", ("start", "run", "open_process", "run_background",
             "_read", "write", "teardown", "cleanup", "workdir"), "patches/verifiers.py", "`lazy_runtime_workdirs`"),
    Internal("verifiers.v1.utils.loaders", ("harness_class", "load_harness", "env_config_type", "default_harness_id"),
             "patches/verifiers.py, envs/loading.py", "`remember_harness_classes`; start-up checks of each seat"),
    Internal("verifiers.v1.utils.decorators", ("inspect", "invoke"), "patches/verifiers.py", "`remember_signatures`"),
    Internal("verifiers.v1.utils.compile", ("validate_pairing",), "envs/loading.py", "start-up checks of each seat"),
    Internal("verifiers.v1.configs.agent", ("agent_config_fields",), "envs/loading.py", "start-up checks of each seat"),
    Internal("verifiers.v1.utils.prime", ("ensure_prime_auth",), "envs/loading.py", "start-up checks of each seat"),
    Internal("verifiers.v1.harnesses.utils.mcp", ("connect_mcp", "MCPConnection", "mcp_content_to_chat_content"),
             "environments/in_process_chat", "the MCP client of the tool loop"),
    # renderers
    Internal("renderers", ("create_renderer",), "patches/renderers.py", "`remember_renders`"),
    Internal("renderers.client", ("json", "parse_generate_response"), "patches/renderers.py",
             "`decode_engine_replies_with_msgspec`"),
    Internal("renderers.base", ("MODEL_RENDERER_MAP",), "renderer.py", "`model.renderer = \"auto\"`"),
    Internal("renderers.parsers", ("TOOL_PARSERS",), "renderer.py", "the renderer's error message"),
    # pydantic
    Internal("pydantic._internal._fields", ("takes_validated_data_argument",), "patches/pydantic.py",
             "`cache_default_factory_inspection`"),
    # torch
    Internal("torch.distributed.checkpoint._traverse", ("set_element",), "trainer/checkpoint.py",
             "filling nested optimizer state on load"),
    Internal("torch.nn.Module", ("_buffers", "_non_persistent_buffers_set"), "trainer/model.py",
             "materializing non-persistent buffers after meta-device init"),
    Internal("torch._inductor.runtime.cache_dir_utils", ("default_cache_dir",), "inference/server.py",
             "telling torch's default inductor cache from one the user chose"),
    # transformers
    Internal("transformers.PreTrainedModel", ("_init_weights",), "trainer/model.py",
             "materializing non-persistent buffers after meta-device init"),
    Internal("transformers.models.qwen3_5.modeling_qwen3_5", ("torch_chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule"), "patches/gdn.py", "`gdn_float32_on_cpu`"),
    Internal("transformers.processing_utils", ("_LazyAutoProcessorMapping", "transformers_module"),
             "patches/transformers.py", "`qwen2_vl_without_torchvision`, `videos_refused_without_torchvision`"),
    # vLLM: its server, started inside rl's gate
    Internal("vllm.entrypoints.launchers.cli_args", ("make_arg_parser", "validate_parsed_serve_args"),
             "inference/server.py", "starting vLLM's server inside rl's ASGI gate"),
    Internal("vllm.entrypoints.launchers.api_server.entry", ("run_server",), "inference/server.py",
             "starting vLLM's server inside rl's ASGI gate"),
    Internal("vllm.entrypoints.serve.utils.api_utils", ("cli_env_setup",), "inference/server.py",
             "starting vLLM's server inside rl's ASGI gate"),
    Internal("vllm.entrypoints.scale_out.token_in_token_out.api_router", ("JSONResponse",), "patches/vllm.py",
             "`render_generate_responses`"),
    Internal("vllm.distributed.device_communicators.shm_broadcast", ("sched_yield",), "patches/vllm.py",
             "`vllm_shm_polling`"),
    Internal("vllm.platforms.cpu.CpuPlatform", ("check_and_update_config",), "patches/vllm.py", "`vllm_cpu_fork`",
             "cpu"),
    # vLLM: weights read back, reloaded and sharded
    Internal("vllm.model_executor.model_loader.reload.layerwise", ("finalize_layerwise_reload",), "inference/worker.py",
             "restoring layers after a reload that stopped halfway"),
    Internal("vllm.lora.worker_manager.WorkerLoRAManager", ("_adapter_manager",), "inference/worker.py",
             "reading back served adapters"),
    Internal("vllm.model_executor.layers.linear.LinearBase", ("tp_rank", "tp_size", "input_size", "output_size"),
             "inference/sharding.py", "the shard of each tensor a tensor-parallel worker serves"),
    Internal("vllm.model_executor.layers.linear.ColumnParallelLinear", ("output_partition_sizes",),
             "inference/sharding.py", "the same"),
    Internal("vllm.model_executor.layers.linear.RowParallelLinear", ("input_size_per_partition",),
             "inference/sharding.py", "the same"),
    Internal("vllm.model_executor.layers.linear.QKVParallelLinear", ("num_kv_head_replicas",),
             "inference/sharding.py", "the same"),
    Internal("vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding", ("shard_indices",),
             "inference/sharding.py", "the same"),
    Internal("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention",
             ("key_dim", "value_dim", "num_v_heads", "conv1d", "A_log", "dt_bias", "activation", "kv_cache", "prefix",
              "rearrange_mixed_qkv"),
             "inference/sharding.py, inference/fingerprint.py, patches/gdn.py",
             "proving linear attention per shard; the float32 GDN op"),
    # vLLM: its CPU kernels and runner, where rl records experts and computes GDN in float32
    Internal("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", ("cpu_gdn_attention_core",
             "_resolve_layer_name"), "patches/gdn.py", "`gdn_float32_on_cpu`", "cpu"),
    Internal("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d", ("causal_conv1d_fn_cpu",
             "causal_conv1d_update_cpu"), "patches/gdn.py", "`gdn_float32_on_cpu`", "cpu"),
    Internal("vllm.model_executor.layers.mamba.mamba_utils", ("is_conv_state_dim_first",), "patches/gdn.py",
             "`gdn_float32_on_cpu`", "cpu"),
    Internal("vllm.forward_context.ForwardContext", ("no_compile_layers", "attn_metadata"), "patches/gdn.py",
             "`gdn_float32_on_cpu`", "cpu"),
    Internal("vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadata", ("num_actual_tokens", "spec_sequence_masks",
             "num_accepted_tokens", "non_spec_state_indices_tensor", "non_spec_query_start_loc", "num_decodes",
             "num_decode_tokens", "num_prefills", "num_prefill_tokens", "has_initial_state"), "patches/gdn.py",
             "`gdn_float32_on_cpu`", "cpu"),
    Internal("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod",
             ("_setup_kernel",), "patches/vllm.py", "`vllm_cpu_moe_reload`", "cpu"),
    Internal("vllm.config.vllm.VllmConfig", ("_verify_aux_output_compatibility", "aux_output_config", "model_config",
             "cache_config"), "patches/routed_experts.py", "`capture_routed_experts_on_cpu`", "cpu"),
    Internal("vllm.v1.worker.cpu_model_runner.CPUModelRunner", ("load_model", "execute_model", "sample_tokens",
             "positions", "input_batch", "vllm_config", "model"), "patches/routed_experts.py",
             "`capture_routed_experts_on_cpu`: each step's routed experts by request and position", "cpu"),
    Internal("vllm.v1.worker.gpu_input_batch.InputBatch", ("req_ids",), "patches/routed_experts.py",
             "the same", "cpu"),
    Internal("vllm.v1.core.sched.output.SchedulerOutput", ("aux_output_connector_metadata",
             "total_num_scheduled_tokens", "num_scheduled_tokens"), "patches/routed_experts.py", "the same", "cpu"),
    Internal("vllm.distributed.aux_output_connector.connector.AuxOutputConnectorMetadata", ("requests",
             "finished_requests"), "patches/routed_experts.py", "the same", "cpu"),
    Internal("vllm.v1.outputs", ("EMPTY_MODEL_RUNNER_OUTPUT",), "patches/routed_experts.py", "the same", "cpu"),
    Internal("vllm.v1.outputs.ModelRunnerOutput", ("aux_output_connector_output",), "patches/routed_experts.py",
             "the same", "cpu"),
    Internal("vllm.model_executor.layers.fused_moe.layer.MoERunner", ("router", "layer_id"),
             "patches/routed_experts.py", "the same", "cpu"),
)


def resolve(path: str):
    """The module, class or object at a dotted path: its longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)


def declared(owner, name: str) -> bool:
    """`owner` has `name`, declares it as a field, or one of its (or its bases') methods sets or reads it."""
    if hasattr(owner, name):
        return True
    if not isinstance(owner, type):
        return False
    for cls in owner.__mro__:
        fields = {**getattr(cls, "__annotations__", {}), **getattr(cls, "__dataclass_fields__", {})}
        if name in fields:
            return True
        for value in vars(cls).values():
            function = getattr(getattr(value, "__func__", value), "fget", getattr(value, "__func__", value))
            code = getattr(function, "__code__", None)
            if code is not None and (name in code.co_names or name in code.co_consts):
                return True
    return False


def missing(rows, device: str) -> list[str]:
    """Each row's absent owner or members, as `library.path.member (library version)`."""
    gone = []
    for row in rows:
        if row.device != "any" and row.device != device:
            continue
        try:
            owner = resolve(row.owner)
        except (ImportError, AttributeError):
            gone.append(f"{row.owner} ({row.library} {installed_version(row.library)})")
            continue
        gone += [f"{row.owner}.{m} ({row.library} {installed_version(row.library)})"
                 for m in row.members if not declared(owner, m)]
    return gone


def check_internals(process: str, device: str = "any") -> None:
    """Every internal rl reads of the libraries `process` uses is there, or PatchTargetMissing naming each one gone."""
    rows = [row for row in INTERNALS if row.process == process]
    gone = missing(rows, device)
    if gone:
        read_from = ", ".join(f"{lib} {READ_FROM[lib]}" for lib in sorted({row.library for row in rows}))
        raise PatchTargetMissing(f"rl reads what these libraries no longer have: {'; '.join(gone)}. rl was read "
                                 f"against {read_from}: install the versions in uv.lock, or update rl "
                                 "(rl/patches/internals.py lists each read and where)")


def table() -> str:
    """INTERNALS as docs/architecture.md shows it."""
    lines = ["| library (read from) | internal | where (rl/) | for |", "|---|---|---|---|"]
    for row in INTERNALS:
        members = ", ".join(f"`{m}`" for m in row.members) or "the module"
        on_cpu = " (CPU hosts)" if row.device == "cpu" else ""
        lines.append(f"| {row.library} {READ_FROM[row.library]} | `{row.owner.partition('.')[2] or row.owner}`: "
                     f"{members}{on_cpu} "
                     f"| {row.where} | {row.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
