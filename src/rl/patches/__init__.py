"""Every change rl makes to another library's code at run time, in one place. Nothing else in rl assigns into
another library's modules. Each patch says what it replaces, why, and who applies it; what each was measured to
save is in benchmarks/RESULTS.md, why each exists in docs/architecture.md ("Patches of other libraries"):

- pydantic: its inspection of default factories is cached (`cache_default_factory_inspection`);
- verifiers: its training client sends requests through our `EngineClient` (`use_engine_client`);
- renderers: each renderer it builds for verifiers' training client remembers its recent renders
  (`remember_renders`): a group's rollouts render the same prompt; its tokenizer remembers encodes of short strings
  (`remember_short_encodes`); verifiers' renderer slots hand out a remembered render on the event loop instead of
  through a thread (`remembered_on_loop`);
- verifiers: its subprocess runtime makes each rollout's working directory at its first use, not at every start
  (`lazy_runtime_workdirs`); harness classes are remembered by id (`remember_harness_classes`); the
  signatures of the hooks and scoring functions it calls, by function (`remember_signatures`); a task's content
  hash, per data object (`remember_task_hashes`); renderers decodes
  engine replies with msgspec (`decode_engine_replies_with_msgspec`); each interception server offers rl's
  in-process chat harness its model routes, called without HTTP (`interception_in_process`);
  all applied by the main() of the orchestrator and of `eval` and by every env-server worker
  (`rl.envs.process_setup.apply_patches`, which hands `apply_orchestrator_patches` the client class: the patches import
  nothing of rl's outside this package but `rl.process`);
- verifiers: each sampled node is stamped, as its turn commits, with the policy version of each token, which rl's
  `EngineClient` read off vLLM's reply (`stamp_policy_versions`, patches/token_versions.py), applied with those;
- verifiers: its eval client reads chat replies through an httpx client that bounds their size and the time to
  read them (`bound_eval_client`), applied with those; its env-server requests carry rl's client configs whole
  (`serve_rl_client_configs`), applied with those in the orchestrator, `eval` and every env-server worker;
- verifiers: its pool builds rl's subclass of its env server in each worker (`serve_env_with`; the class,
  rl/envs/worker_server.py, answers rl's requests for a group's episodes, holds rl's shared HTTP session, tunes the GC,
  drops a request whose id it could not decode and runs no episode whose client names a variable or endpoint the
  server does not allow), applied by rl's env server before its workers fork; each worker sends each episode's traces
  once, when it ends (`send_traces_once`, applied by every env-server worker: `rl.envs.process_setup.set_up_worker`);
  its pool's health reply carries the live workers (`answer_health_with`), set by the env server's worker watch; its
  pool forks its workers from the broker instead of spawning them
  (`fork_pool_workers`), applied by rl's env server;
- vLLM: its shared-memory queues sleep between polls instead of spinning (`vllm_shm_polling`), a vLLM
  general plugin that vLLM runs in each of its processes, active only where `RL_VLLM_SHM_POLL_S` is set
  (the inference server sets it on CPU hosts);
- vLLM: its CPU platform starts the engine core and workers by fork, as vLLM does where no accelerator is
  initialised, not by spawn, and each forked worker takes the OpenMP threads and cores vLLM chose for it
  (`vllm_cpu_fork`), applied by the inference server on CPU hosts (`rl.inference.server.cpu_start_method`);
- vLLM: its generate route answers through the inference gate's response class, which adds token strings and
  writes the response once (`render_generate_responses`), applied by the gate when vLLM builds it;
- vLLM: its CPU runner records the experts each token was routed to, which vLLM records only in its GPU runner
  (`capture_routed_experts_on_cpu`, patches/routed_experts.py), for an MoE with `inference.router_replay`; its
  in-place reload packs a CPU MoE layer's experts for the kernel again (`vllm_cpu_moe_reload`), which vLLM 0.32
  skips, for an MoE: both applied on CPU hosts by the inference server and, through `vllm_cpu_moe` (a general
  plugin active where the server sets `RL_VLLM_CPU_MOE`), in every process vLLM starts;
- vLLM: its CPU op for Gated DeltaNet (Qwen3.5's linear attention) computes float32 with transformers' torch delta
  rule, where vLLM's kernels take bf16 only (`gdn_float32_on_cpu`, patches/gdn.py), a general plugin active where the
  inference server sets `RL_VLLM_CPU_GDN_FLOAT32` (a hybrid on a CPU host);
- transformers: its torchvision image processor module for Qwen2-VL is its PIL twin where torchvision is absent, so
  that vLLM's Qwen3.5 module imports on the CPU stack, and a processor's video processor (torchvision's) is a stand-in
  that refuses videos, so that vLLM serves images (`qwen2_vl_without_torchvision`, `videos_refused_without_torchvision`,
  patches/transformers.py), a general plugin.

The package: `verifiers` (verifiers, its env-server pool included), `token_versions` (verifiers' sampled nodes,
stamped), `pydantic`, `renderers` (in the processes that run episodes), `vllm` and `routed_experts` (in vLLM's
processes), `gdn` (vLLM's CPU linear attention, in its processes), `transformers` (in vLLM's processes), `local_route`
(an aiohttp handler called in process); `targets` holds what they share, and this module
names every patch. The imports of the patched libraries stay inside the functions: vLLM loads this module in every
process it starts, where neither pydantic's internals nor verifiers are needed. A patch whose target is gone (the
library changed) raises `PatchTargetMissing` when it is applied, at start-up: it never silently stops applying.
"""

from __future__ import annotations

from rl.patches.targets import (  # noqa: F401
    APPLIED, PatchTargetMissing, installed_version, once, patch_target, require_members,
)
from rl.patches.verifiers import (  # noqa: F401 - the patches, by name
    apply_orchestrator_patches, bound_eval_client, cache_default_factory_inspection,
    interception_in_process, lazy_runtime_workdirs, remember_harness_classes, remember_signatures,
    remember_task_hashes, send_traces_once, serve_env_with, serve_rl_client_configs,
    use_engine_client, answer_health_with, fork_pool_workers, pool_workers,
)
from rl.patches.token_versions import stamp_policy_versions  # noqa: F401
from rl.patches.routed_experts import capture_routed_experts_on_cpu  # noqa: F401
from rl.patches.renderers import (  # noqa: F401
    decode_engine_replies_with_msgspec, remember_renders, remember_short_encodes, remembered_on_loop,
)
from rl.patches.gdn import GDN_ENV, gdn_float32_on_cpu  # noqa: F401
from rl.patches.transformers import qwen2_vl_without_torchvision  # noqa: F401
from rl.patches.vllm import (  # noqa: F401
    CPU_POLL_S, POLL_ENV, START_METHOD_ENV, poll_interval, render_generate_responses, vllm_cpu_fork,
    MOE_ENV, vllm_cpu_moe, vllm_cpu_moe_reload, vllm_shm_polling,
)
