"""Configuration of the `eval` command: what to evaluate, where the model is served, where results go."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import ChatModelConfig, Section, Settings
from rl.envs.config import EnvConfig, check_env_labels
from rl.inference.config import InferenceConfig
from rl.envs.chat_replies import MAX_REPLY_BYTES
from rl.orchestrator.config import EvalSettings, RolloutConfig
from rl.config import API_KEY_VAR

ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EvalClientConfig(Section):
    base_url: Annotated[
        str | None,
        Field(description="a running OpenAI-compatible server to evaluate on: a plain `vllm serve`, a hosted API "
                          "(https://api.openai.com/v1), rl's inference server; a URL without a path gets /v1. Unset: "
                          "eval starts rl's inference server"),
    ] = None
    api: Annotated[
        Literal["auto", "chat", "tokens"],
        Field(description="how rollouts sample. 'chat': OpenAI chat completions, which any OpenAI-compatible server "
                          "answers (it applies its own chat template and tool-call parser; results hold the chat "
                          "messages). 'tokens': as training does, prompts rendered with model.renderer and token ids "
                          "sampled through rl's inference server only (results hold the rendered text). 'auto': "
                          "tokens on the server eval starts, chat at client.base_url"),
    ] = "auto"
    api_key_var: Annotated[
        str,
        Field(description="the NAME of the environment variable that holds the server's API key, e.g. OPENAI_API_KEY "
                          "(never the key itself), sent as a bearer token; a variable other than the default must be "
                          f"set, the default {API_KEY_VAR} (rl's servers' key) sends 'EMPTY' where unset"),
    ] = API_KEY_VAR
    served_model: Annotated[
        str | None, Field(description="the model name that server serves (a hosted API's model id); unset: model.name")
    ] = None
    max_reply_bytes: Annotated[
        int,
        Field(ge=1024, description="with the chat api: the largest reply read from the server, in bytes; a larger one "
                                   "fails its rollout as it streams in, read no further (replies are asked for "
                                   "uncompressed, and each is read whole within rollout.timeout_s or refused)"),
    ] = MAX_REPLY_BYTES
    startup_timeout_s: Annotated[
        float,
        Field(gt=0, description="deadline for the server to answer: /health on the server eval starts, /v1/models at "
                                "client.base_url (a hosted API has no /health)"),
    ] = 600.0

    @field_validator("api_key_var")
    @classmethod
    def _a_variable_name(cls, value: str) -> str:
        if not ENV_VAR_NAME.fullmatch(value):  # the value is not echoed: it may be a pasted key
            raise ValueError("give the name of the environment variable that holds the API key (letters, digits, _; "
                             "e.g. OPENAI_API_KEY), not the key: keys do not belong in configs or command lines")
        return value

    def resolved_api(self) -> Literal["chat", "tokens"]:
        if self.api != "auto":
            return self.api
        return "tokens" if self.base_url is None else "chat"


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
    rollout: Annotated[
        RolloutConfig,
        Field(description="the orchestrator's [rollout]: each rollout's deadline (eval's default 1 h: a server that "
                          "stops answering fails it, and its group is retried) and a failed group's retries"),
    ] = RolloutConfig(timeout_s=3600.0)
    adapter: Annotated[
        Path | None,
        Field(description="a LoRA adapter directory (PEFT layout: adapter_config.json, adapter_model.safetensors; a "
                          "LoRA run's weights/step_k) evaluated over model.name, its base model; eval's own server "
                          "loads and verifies it. With client.base_url, name the served adapter in "
                          "client.served_model"),
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
