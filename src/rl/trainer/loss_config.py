"""The loss's configuration (`trainer.loss`): normalisation, objective, off-policy and mismatch corrections.
Variants are discriminated unions on `type`; trainer/loss.py and trainer/corrections.py give the formulas."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BeforeValidator, Field, model_validator

from rl.config import Section


class DapoNorm(Section):
    """sum over every trained token of the step / number of those tokens (all ranks, all micro-batches)."""

    type: Annotated[Literal["dapo"], Field(description="token-level mean over the whole step")] = "dapo"


class GrpoNorm(Section):
    """mean over each sample's trained tokens, then mean over the step's samples."""

    type: Annotated[Literal["grpo"], Field(description="per-sample token mean, then mean over samples")] = "grpo"


class DrGrpoNorm(Section):
    """sum over every trained token / (samples in the step * tokens_per_sample), a constant per step shape."""

    type: Annotated[Literal["dr_grpo"], Field(description="token sum over a constant (Dr. GRPO)")] = "dr_grpo"
    tokens_per_sample: Annotated[
        int | None, Field(ge=1, description="denominator per sample (max completion tokens); unset: seq_len")
    ] = None


NormConfig = Annotated[Union[DapoNorm, GrpoNorm, DrGrpoNorm], Field(discriminator="type")]


class AutoMismatchCorrection(Section):
    """Left to the device (`resolve_device_defaults`): on CUDA, where bf16 training beside vLLM's kernels differs
    from inference, the token mask (prime-rl's default); none on CPU (float32 on both sides). Unresolved, as in a
    unit test that builds the config itself, it corrects nothing, as on CPU."""

    type: Annotated[Literal["auto"], Field(description="mask on CUDA, none on CPU")] = "auto"


class NoMismatchCorrection(Section):
    type: Annotated[Literal["none"], Field(description="no off-policy or mismatch correction")] = "none"


class TruncateRatio(Section):
    """Truncated importance weights: the ratio is capped at `cap` (bounds negative-advantage tokens)."""

    type: Annotated[Literal["truncate"], Field(description="cap the importance ratio at `cap`")] = "truncate"
    cap: Annotated[float, Field(gt=1, description="largest importance ratio a token may carry")] = 2.0


Against = Annotated[
    Literal["sampled", "rescored"],
    Field(description="sampled: the ratio to the sampling logprobs (the policy's steps since sampling and the engines' "
                      "difference together); rescored: to inference's logprobs of the same tokens under the policy "
                      "being trained (the engines' difference alone; orchestrator.rescore, which rl sets, re-scores "
                      "stale samples by prefill: orchestrator/rescore.py)"),
]


class MaskRatio(Section):
    """Tokens whose |log ratio| exceeds `max_log_ratio` contribute nothing to the loss."""

    type: Annotated[Literal["mask"], Field(description="drop tokens with |log ratio| > max_log_ratio")] = "mask"
    max_log_ratio: Annotated[float, Field(gt=0, description="bound on |log pi_theta - log pi_old|")] = 1.0
    against: Against = "sampled"


class RatioBounds(Section):
    @model_validator(mode="after")
    def _ordered(self):
        if not self.low < self.high:
            raise ValueError(f"{self.type}: low ({self.low}) must be below high ({self.high})")
        return self


class IcePopMask(RatioBounds):
    """IcePop's token mask: tokens whose ratio leaves [low, high] contribute nothing."""

    type: Annotated[Literal["icepop"], Field(description="drop tokens with ratio outside [low, high]")] = "icepop"
    low: Annotated[float, Field(ge=0, description="smallest ratio a trained token may have")] = 0.5
    high: Annotated[float, Field(gt=1, description="largest ratio a trained token may have")] = 5.0
    against: Against = "sampled"


class GeoMask(RatioBounds):
    """A sample whose geometric mean ratio (exp of its tokens' mean log ratio) leaves [low, high] contributes
    nothing; the bounds are SkyRL's recommendation."""

    type: Annotated[Literal["geo_mask"], Field(description="drop samples whose geometric mean ratio leaves "
                                                           "[low, high]")] = "geo_mask"
    low: Annotated[float, Field(gt=0, lt=1, description="smallest geometric mean ratio")] = 0.99
    high: Annotated[float, Field(gt=1, description="largest geometric mean ratio")] = 1.01
    against: Against = "sampled"


class SequenceTruncate(Section):
    """Truncated sequence importance weights: a sample whose ratio (the product of its tokens') exceeds `cap` has
    its tokens' loss scaled by cap / ratio."""

    type: Annotated[Literal["seq_truncate"], Field(description="cap each sample's importance ratio at `cap`")] = (
        "seq_truncate"
    )
    cap: Annotated[float, Field(gt=1, description="largest importance ratio a sample may carry")] = 2.0


class OutlierMask(RatioBounds):
    """A sample with any token whose ratio leaves [low, high] contributes nothing (SkyRL's outlier bounds)."""

    type: Annotated[Literal["outlier_mask"], Field(description="drop samples with a token's ratio outside "
                                                               "[low, high]")] = "outlier_mask"
    low: Annotated[float, Field(ge=0, lt=1, description="smallest ratio any token may have")] = 1e-4
    high: Annotated[float, Field(gt=1, description="largest ratio any token may have")] = 100.0
    against: Against = "sampled"


Correction = Annotated[
    Union[TruncateRatio, MaskRatio, IcePopMask, GeoMask, SequenceTruncate, OutlierMask], Field(discriminator="type")
]


def _as_list(value):
    """A single correction's table stands for a list of one (how `mismatch` was written before it stacked)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return [value] if isinstance(value, (dict, Section)) and kind not in ("auto", "none") else value


MismatchConfig = Annotated[
    Union[AutoMismatchCorrection, NoMismatchCorrection, list[Correction]], BeforeValidator(_as_list)
]


def corrections(mismatch) -> list:
    """The corrections `mismatch` stands for, in order (none for auto unresolved, or none)."""
    return mismatch if isinstance(mismatch, list) else []


def needs_rescored(mismatch) -> bool:
    """Whether a correction reads inference's logprobs under the trained policy (a mask `against = "rescored"`)."""
    return any(getattr(c, "against", "sampled") == "rescored" for c in corrections(mismatch))


class PPOObjective(Section):
    """Clipped token ratios (PPO; DAPO's clip-higher with the loss's eps_low / eps_high)."""

    type: Annotated[Literal["ppo"], Field(description="clipped token importance ratios")] = "ppo"


class GSPOObjective(Section):
    """GSPO: each sample's ratio is the geometric mean of its tokens' (exp of their mean log ratio), clipped to
    [1 - eps_low, 1 + eps_high]; every token of the sample carries it (the paper's token form, equal in value)."""

    type: Annotated[Literal["gspo"], Field(description="clipped sequence (geometric mean) ratios")] = "gspo"
    eps_low: Annotated[float, Field(ge=0, lt=1, description="lower clip of the sequence ratio")] = 3e-4
    eps_high: Annotated[float, Field(ge=0, description="upper clip of the sequence ratio")] = 4e-4


class CISPOObjective(Section):
    """CISPO: the importance weight is clipped, never the gradient: loss -sg(min(r_t, max_weight)) A_t log pi_theta(t)
    for every trained token (no lower bound, as MiniMax-M1 sets it)."""

    type: Annotated[Literal["cispo"], Field(description="clipped importance weights, every token's gradient kept")] = (
        "cispo"
    )
    max_weight: Annotated[float, Field(gt=1, description="largest importance weight a token carries")] = 2.0


ObjectiveConfig = Annotated[Union[PPOObjective, GSPOObjective, CISPOObjective], Field(discriminator="type")]


class LossConfig(Section):
    eps_low: Annotated[float, Field(ge=0, lt=1, description="lower clip: ratio >= 1 - eps_low")] = 0.2
    eps_high: Annotated[float, Field(ge=0, description="upper clip (clip-higher): ratio <= 1 + eps_high")] = 0.28
    norm: Annotated[NormConfig, Field(description="how token losses are normalised (type = dapo|grpo|dr_grpo)")] = (
        DapoNorm()
    )
    objective: Annotated[
        ObjectiveConfig, Field(description="the policy objective (type = ppo|gspo|cispo)")
    ] = PPOObjective()
    mismatch: Annotated[
        MismatchConfig,
        Field(description="off-policy and train-inference mismatch corrections (trainer/corrections.py): auto, "
                          "none, or a list of tables that stacks, by type and its fields: truncate (cap), mask "
                          "(max_log_ratio), icepop, geo_mask, outlier_mask (low, high), seq_truncate (cap); one table "
                          "is a list of one; a mask's ratio is `against` sampled or rescored logprobs; auto: mask "
                          "on CUDA, none on CPU"),
    ] = AutoMismatchCorrection()
    beta: Annotated[
        float, Field(ge=0, description="KL penalty (k3) to the reference (base) model; 0 loads no reference")
    ] = 0.0
    distill: Annotated[
        float,
        Field(ge=0, description="on-policy distillation: weight of the per-token reverse KL to the teacher "
                                "(orchestrator.teacher), added to each token's advantage; 0: off"),
    ] = 0.0
    distill_top_k: Annotated[
        float,
        Field(ge=0, description="on-policy distillation's dense term: weight of the KL from the teacher's top-k "
                                "distribution (orchestrator.teacher.top_k) to the student's at every trained token; "
                                "0: off"),
    ] = 0.0
    reward_weight: Annotated[
        float, Field(ge=0, description="weight of the reward advantage; 0 with distill > 0: pure distillation")
    ] = 1.0
    router_replay: Annotated[
        bool, Field(description="mixture-of-experts: route every token to the experts inference recorded for it "
                                "(trainer/moe.py); the batch must carry them (inference records them for an MoE)")
    ] = True
    router_aux_loss_coef: Annotated[
        float, Field(ge=0, description="mixture-of-experts: weight of the router's load-balancing loss; 0 (off) for "
                                       "RL: it moves the policy whatever the reward (trainer/moe.py)")
    ] = 0.0
    distill_baseline: Annotated[
        bool, Field(description="subtract the step's mean reverse KL (every trained token, all ranks) from each "
                                "token's before weighing it by distill: a baseline, so that the update moves tokens "
                                "by how much worse than the step's average the teacher finds them")
    ] = True

    @model_validator(mode="after")
    def _something_to_learn(self):
        if self.reward_weight == 0 and self.distill == 0 and self.distill_top_k == 0:
            raise ValueError("loss.reward_weight = 0 and loss.distill = 0 and loss.distill_top_k = 0 leave nothing to "
                             "learn from: set one above 0")
        return self
