"""Every change rl makes to another library's code at run time, in one place. Nothing else in rl assigns into
another library's modules. Each patch says what it replaces, why, and who applies it; docs/architecture.md ("Patches
of other libraries") has them in one table with what each was measured to save, and `internals.py` lists every
internal name rl reads or replaces (each process checks its own at start-up: `check_internals`).

The package: `verifiers` (verifiers, its env-server pool included), `token_versions` (verifiers' sampled nodes,
stamped), `pydantic`, `renderers` (in the processes that run episodes), `vllm` and `routed_experts` (in vLLM's
processes), `gdn` (vLLM's CPU linear attention, in its processes), `transformers` (in vLLM's processes), `local_route`
(an aiohttp handler called in process); `targets` holds what they share. The imports of the patched libraries stay
inside the functions: vLLM loads this module in every process it starts, where neither pydantic's internals nor
verifiers are needed. A patch whose target is gone (the library changed) raises `PatchTargetMissing` when it is
applied, at start-up: it never silently stops applying.
"""

from __future__ import annotations

from rl.patches.internals import check_internals  # noqa: F401
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
