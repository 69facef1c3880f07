"""Which renderer turns a model's chats into tokens and parses its replies (verifiers' `renderers`).

verifiers' training client renders every chat request itself (prompt token ids for vLLM's token route) and
parses the completion back into text and tool calls. The renderer is chosen per model:

- `auto` (default): verifiers' renderer for the model's hub name (`renderers.MODEL_RENDERER_MAP`: Qwen3
  models get the Qwen3 renderer, which handles tools and keeps multi-turn token streams stable); for a local
  checkpoint of a family verifiers knows by hub name only (Qwen3.5, by its config's model_type) that family's
  renderer, thinking on or off as its chat template answers; for any other model (a local directory, a
  fine-tune) the model's own chat template, with Qwen3's tool-call parser where the template writes tool calls
  as `<tool_call>` JSON and the tokenizer has those tokens (Qwen2.5/Qwen3 fine-tunes, Hermes-style models, rl's
  tiny Qwen3), else without tools;
- a renderer name (`qwen3`, `default`, ...), or a table of its fields, e.g.
  `{name = "default", tool_parser = "qwen3"}`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError
from renderers import create_renderer
from renderers.base import MODEL_RENDERER_MAP
from renderers.parsers import TOOL_PARSERS
from renderers.configs import AutoRendererConfig, DefaultRendererConfig, RendererConfig, config_from_name

from rl.config import ConfigError, text_model_config

RendererSetting = str | dict[str, Any]
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
# Families whose renderer verifiers maps from hub names only, found for a local checkpoint by its language model's
# model_type (a Qwen3.5 directory keeps it in text_config).
FAMILY_RENDERERS = {"qwen3_5_text": "qwen3.5", "qwen3_5_moe_text": "qwen3.5"}


def renderer_config(setting: RendererSetting, model: str) -> tuple[Any, str]:
    """The typed renderer config for `model` and why it was chosen; ConfigError names a bad setting."""
    try:
        if isinstance(setting, dict):
            return TypeAdapter(RendererConfig).validate_python(setting), "as configured"
        if setting != "auto":
            return config_from_name(setting), "as configured"
    except (ValidationError, ValueError) as e:
        raise ConfigError(f"model.renderer = {setting!r}: {e}") from None
    if model in MODEL_RENDERER_MAP:
        return config_from_name(MODEL_RENDERER_MAP[model]), f"verifiers' renderer for {model}"
    model_type = text_model_config(model).get("model_type")
    if model_type in FAMILY_RENDERERS:
        return family_renderer(FAMILY_RENDERERS[model_type], model), f"verifiers' renderer for {model_type} models"
    if writes_qwen3_tool_calls(load_tokenizer(model)):
        return (DefaultRendererConfig(tool_parser="qwen3"),
                "the model's chat template, which writes tool calls as <tool_call> JSON (Qwen3's parser)")
    return DefaultRendererConfig(), "the model's chat template (it writes no <tool_call>: no tools)"


def family_renderer(name: str, model: str) -> Any:
    """The renderer `name` with thinking on or off as the model's chat template opens its answers: Qwen3.5's
    renderer knows that default for hub names only (its small checkpoints answer with thinking off) and takes it on
    for any other, which would put a prompt before a local small model that its template never showed it."""
    config = config_from_name(name)
    if "enable_thinking" not in type(config).model_fields:
        return config
    tokenizer = load_tokenizer(model)
    if not tokenizer.chat_template:
        return config
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                           tokenize=False)
    return config.model_copy(update={"enable_thinking": not prompt.rstrip().endswith("</think>")})


def writes_qwen3_tool_calls(tokenizer) -> bool:
    """Whether the chat template renders tool calls in <tool_call> tags that are single tokens."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    return "<tool_call>" in template and all(token in vocab for token in TOOL_CALL_TOKENS)


def supports_tools(config: Any, model: str) -> bool:
    """Whether the renderer `config` builds for `model` can offer tools and parse tool calls."""
    if isinstance(config, AutoRendererConfig):
        raise ValueError("resolve auto with renderer_config first")
    renderer = create_renderer(load_tokenizer(model), config)
    return bool(getattr(renderer, "supports_tools", True))


def describe(config: Any) -> str:
    """One line for the log: the renderer's name and its non-default fields."""
    fields = config.model_dump(exclude_defaults=True, exclude={"name"})
    return config.name + (f" {fields}" if fields else "")


@cache
def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def chat_renderer(setting: RendererSetting, model: str, environments: list) -> tuple[Any, str]:
    """The renderer for `model` and why it was chosen, refused (ConfigError) where an environment serves
    tools that it cannot offer or parse: this is found at start-up, not by every rollout failing."""
    config, why = renderer_config(setting, model)
    with_tools = [env for env in environments if env.toolsets]
    if with_tools and not supports_tools(config, model):
        names = ", ".join(f"{env.name!r} (toolsets {', '.join(env.toolsets)})" for env in with_tools)
        raise ConfigError(
            f"environment {names} serves tools, but model {model!r} renders with {describe(config)} ({why}), "
            "which cannot offer tools or parse tool calls; set model.renderer to one that can: the model's own "
            "(e.g. 'qwen3'), or {name = 'default', tool_parser = '<parser>'} where its chat template renders "
            f"tools (parsers: {', '.join(sorted(TOOL_PARSERS))})"
        )
    return config, why
