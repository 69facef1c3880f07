"""vLLM: its routed-experts output (`--enable-return-routed-experts`, router replay's record) on the CPU runner.

vLLM 0.32 records each token's experts only in its V2 model runner, which needs Triton (no CPU backend on PyPI):
on CPU the config check refuses the option. Its CPU router already offers the capture callback the V2 runner binds
(`set_capture_fn`, logical expert ids per MoE layer), and its scheduler, output processor and HTTP routes already
carry the rows once a runner reports them. So this patch, applied by rl's inference server before vLLM starts and by
rl's `vllm_cpu_moe` plugin in every process vLLM starts:

- lets the config check pass on CPU without the V2 runner and without prefix caching, which the server turns off
  for it: a prefix-cache hit is not computed again, so its rows would be unknown;
- binds every MoE layer's router to a per-step record in the V1 CPU runner, keeps each running request's rows by
  position, and reports the rows the scheduler asks for (`aux_output_connector_output`), as the V2 runner does.
"""

from __future__ import annotations

import numpy as np

from rl.patches.targets import patch_target

UNKNOWN = -1  # a position this worker never computed; rows are int16, as rl's batches hold them


def capture_routed_experts_on_cpu() -> None:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "rl_routed_experts", False):
        return
    patch_target(VllmConfig, "_verify_aux_output_compatibility", "vllm")
    VllmConfig._verify_aux_output_compatibility = _verify_on_cpu
    load, execute, sample = (patch_target(CPUModelRunner, name, "vllm")
                             for name in ("load_model", "execute_model", "sample_tokens"))

    def load_model(self, *args, **kwargs):
        loaded = load(self, *args, **kwargs)
        if self.vllm_config.aux_output_config.enabled:
            self.rl_routes = RouteRecord(self.model)
        return loaded

    def execute_model(self, scheduler_output, *args, **kwargs):
        record: RouteRecord | None = getattr(self, "rl_routes", None)
        if record is None:
            return execute(self, scheduler_output, *args, **kwargs)
        record.step.clear()
        output = execute(self, scheduler_output, *args, **kwargs)
        record.after_step(self, scheduler_output)
        return record.attach(output)

    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        record = getattr(self, "rl_routes", None)
        return output if record is None else record.attach(output)

    CPUModelRunner.load_model, CPUModelRunner.execute_model = load_model, execute_model
    CPUModelRunner.sample_tokens = sample_tokens
    CPUModelRunner.rl_routed_experts = True


def _verify_on_cpu(self) -> None:
    """vLLM's check, less its V2-runner and prefix-cache requirements (this patch is the CPU runner's recorder)."""
    if not self.aux_output_config.enabled:
        return
    if self.model_config.runner_type != "generate" or not self.model_config.is_moe:
        raise ValueError("routed experts are recorded only for a generating mixture-of-experts model")
    if self.cache_config.enable_prefix_caching:
        raise ValueError("routed experts on CPU need prefix caching off: a cached prompt block is not computed again")


class RouteRecord:
    """One worker's record of the experts each running request's tokens were routed to."""

    def __init__(self, model):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.step: dict[int, np.ndarray] = {}  # MoE layer -> [tokens of this step, top_k]
        self.rows: dict[str, np.ndarray] = {}  # request -> [positions, layers, top_k] int16, UNKNOWN where not computed
        self.pending = None  # this step's rows for the scheduler, until an output carries them
        for module in model.modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(lambda ids, layer=module.layer_id: self.step.__setitem__(
                    layer, ids.detach().to("cpu", copy=True).numpy()))

    def after_step(self, runner, scheduler_output) -> None:
        from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

        wanted = scheduler_output.aux_output_connector_metadata
        ends = self._store(runner, scheduler_output) if self.step else {}
        if wanted is not None:
            self.pending = {request: AuxRequestOutput(start, self.rows[request][start:ends[request]].copy())
                            for request, start in wanted.requests.items() if request in ends}
            for request in wanted.finished_requests:
                self.rows.pop(request, None)

    def _store(self, runner, scheduler_output) -> dict[str, int]:
        """This step's rows into each request's record by position; each request's end position."""
        tokens = scheduler_output.total_num_scheduled_tokens
        ids = np.stack([self.step[layer][:tokens] for layer in sorted(self.step)], 1)  # [tokens, layers, top_k]
        ids = ids.astype(np.int16)
        positions = runner.positions[:tokens].numpy()
        offset, ends = 0, {}
        for request in runner.input_batch.req_ids:
            count = scheduler_output.num_scheduled_tokens.get(request, 0)
            if not count:
                continue
            first, end = int(positions[offset]), int(positions[offset + count - 1]) + 1
            rows = self.rows.get(request)
            if rows is None or len(rows) < end:
                grown = np.full((max(end, 2 * (0 if rows is None else len(rows)), 64), *ids.shape[1:]), UNKNOWN,
                                ids.dtype)
                if rows is not None:
                    grown[:len(rows)] = rows
                self.rows[request] = rows = grown
            rows[first:end] = ids[offset:offset + count]
            ends[request] = end
            offset += count
        return ends

    def attach(self, output):
        """The rows waiting for the scheduler go with the first real output of the step."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if self.pending is not None and output is not None and output is not EMPTY_MODEL_RUNNER_OUTPUT \
                and hasattr(output, "aux_output_connector_output"):
            output.aux_output_connector_output, self.pending = self.pending, None
        return output
