"""Configuration of the `eval` command: what to evaluate, where the model is served, where results go."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import ChatModelConfig, EnvConfig, Section, Settings, check_env_labels
from rl.inference.config import InferenceConfig
from rl.orchestrator.config import EvalSettings


class EvalClientConfig(Section):
    base_url: Annotated[
        str | None,
        Field(description="a running server to evaluate on (rl's inference, or vLLM with --enable-scale-out); "
                          "unset: eval starts its own"),
    ] = None
    served_model: Annotated[
        str | None, Field(description="the model name that server serves; unset: model.name")
    ] = None
    startup_timeout_s: Annotated[float, Field(gt=0, description="deadline for the server to become healthy")] = 600.0


class EvalCommandConfig(Settings, EvalSettings):
    model_config = SettingsConfigDict(env_prefix="RL_EVAL__")

    model: ChatModelConfig = ChatModelConfig()
    env: Annotated[list[EnvConfig], Field(min_length=1, description="environments to evaluate ([[env]] tables)")] = [
        EnvConfig(id="reverse-text")
    ]
    num_examples: Annotated[
        int | None, Field(ge=1, description="tasks evaluated per environment (the first N); unset: all")
    ] = None
    output_dir: Annotated[
        Path | None, Field(description="where results.jsonl and summary.json go; unset: outputs/eval-<time>")
    ] = None
    max_concurrent: Annotated[int, Field(ge=1, description="rollouts in flight at once")] = 64
    rollout_timeout_s: Annotated[
        float | None, Field(gt=0, description="deadline for one rollout, from when it holds a concurrency slot")
    ] = None
    max_retries: Annotated[
        int, Field(ge=0, description="times a failed group is run again before it is dropped (and reported)")
    ] = 1
    adapter: Annotated[
        Path | None,
        Field(description="a LoRA adapter directory (PEFT layout: adapter_config.json, adapter_model.safetensors; a "
                          "LoRA run's weights/step_k) evaluated over model.name, its base model; eval's own server "
                          "loads and verifies it. With client.base_url, name the served adapter in client.served_model"),
    ] = None
    client: EvalClientConfig = EvalClientConfig()
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig, description="the server eval starts when client.base_url is unset"
    )

    @model_validator(mode="after")
    def _check(self):
        check_env_labels(self.env, "env")
        if "model" in self.inference.model_fields_set and self.inference.model.name != self.model.name:
            raise ValueError(
                f"inference.model.name = {self.inference.model.name!r} contradicts model.name = "
                f"{self.model.name!r}; set model.name only"
            )
        if self.adapter is not None and self.client.base_url is not None:
            raise ValueError("adapter is loaded by the server eval starts; a server at client.base_url must serve it "
                             "already: name it with client.served_model and leave adapter unset")
        return self
