"""Configuration shared by every process: the settings base class, the command-line grammar and the
pieces of config that more than one process uses.

Precedence, lowest first: field defaults < TOML files (``@ file.toml``, left to right) < environment
variables (``RL_<PROCESS>__<SECTION>__<FIELD>``) < command-line overrides (``--section.field value``).
"""

from __future__ import annotations

import json
import sys
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer
from pydantic_settings import BaseSettings, EnvSettingsSource, InitSettingsSource, SettingsConfigDict

from rl.atomic import atomic_write_text
from rl.config_help import config_help
from rl.config_secrets import (  # noqa: F401 - what rl's configs and their readers import from here
    SECRET, SECRET_FIELDS, SECRET_MASK, WITH_SECRETS, Secret, hide_secrets, is_secret, public_config,
    repr_args_without_secrets, secret_fields, secrets_on_command_line, url_without_password, without_secrets,
)

# (class, TOML layer) of the config being built; read by settings_customise_sources (a classmethod, so
# it cannot take the files as an argument). Keyed by class so nested defaults do not pick it up.
_toml_layer: ContextVar[tuple[type | None, dict[str, Any]]] = ContextVar("_toml_layer", default=(None, {}))

API_KEY_VAR = "RL_INFERENCE_API_KEY"  # holds the key of rl's inference servers, read by each of their clients


class ConfigError(ValueError):
    """A configuration mistake made by the user: the message names the field and the fix."""


class Section(BaseModel):
    """A nested config table: unknown keys are errors; secrets are hidden from its dumps and its repr."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    _hide_secrets = model_serializer(mode="wrap")(hide_secrets)
    __repr_args__ = repr_args_without_secrets


class Settings(BaseSettings):
    """Base of the per-process configs: defaults < TOML < environment < CLI; secrets hidden as in Section."""

    model_config = SettingsConfigDict(
        extra="forbid", env_nested_delimiter="__", validate_assignment=True, nested_model_default_partial_update=True
    )
    _hide_secrets = model_serializer(mode="wrap")(hide_secrets)
    __repr_args__ = repr_args_without_secrets

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        target, toml_data = _toml_layer.get()
        toml_data = toml_data if target is settings_cls else {}
        return (init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=toml_data))


def optional_section(value: Any) -> Any:
    """For a section that is off unless given (`X | None`): `--slurm` alone turns it on with its defaults,
    `--slurm false` off; `--slurm.field value` sets fields too."""
    return {"true": {}, "false": None}.get(value, value) if isinstance(value, str) else value


class ModelConfig(Section):
    name: Annotated[
        str, Field(description="Hugging Face model id or local directory (tokenizer included)")
    ] = "models/tiny"


class ChatModelConfig(ModelConfig):
    """The model as the processes that chat with it see it (orchestrator, eval)."""

    renderer: Annotated[
        str | dict[str, Any],
        Field(description="how chats become tokens and replies tool calls: 'auto' (verifiers' renderer for the "
                          "model's name, else its chat template with a tool parser where it writes <tool_call> "
                          "JSON), a renderer name ('qwen3', 'default', ...) or a table of its fields, e.g. "
                          "{name = 'default', tool_parser = 'qwen3'}"),
    ] = "auto"


class WandbConfig(Section):
    project: Annotated[str | None, Field(description="W&B project; unset disables W&B")] = None
    name: Annotated[str | None, Field(description="W&B run name (a suffix names the process)")] = None
    mode: Annotated[
        Literal["online", "offline"], Field(description="offline writes to <output_dir>/wandb with no network")
    ] = "offline"


def local_model_dir(name: str) -> str:
    """The model's files on disk: a directory as given, or the hub snapshot of a model id (served weights are
    verified against files, so vLLM must load from a directory)."""
    if Path(name).is_dir():
        return name
    from huggingface_hub import snapshot_download

    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])


def text_model_config(model: str) -> dict:
    """A local model directory's config.json, the language model's part of it where the model has others (a
    vision-language checkpoint keeps it under `text_config`); {} for anything else, a hub id included."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return config.get("text_config") or config


def is_moe(model: str) -> bool:
    """Whether a local model describes a mixture of experts (Qwen3-MoE's, Qwen3.5-MoE's and Mixtral's names)."""
    config = text_model_config(model)
    return any(config.get(key) for key in ("num_experts", "num_local_experts"))


def is_hybrid(model: str) -> bool:
    """Whether a local model has linear-attention layers (Qwen3.5's and Qwen3-Next's Gated DeltaNet) beside its full
    attention ones: its servers keep a recurrent state per sequence."""
    return "linear_attention" in text_model_config(model).get("layer_types", ())


class CkptConfig(Section):
    interval: Annotated[
        int | None, Field(ge=1, description="checkpoint every N steps (and at the end); unset: only at the end")
    ] = None
    keep: Annotated[int, Field(ge=1, description="number of most recent checkpoints to keep")] = 2

    def due(self, step: int, final_step: int) -> bool:
        """Whether the state after `step` finished optimizer steps is checkpointed (same rule everywhere)."""
        return step == final_step or (self.interval is not None and step % self.interval == 0)


# --------------------------------------------------------------------------------------------------
# Command-line grammar:  @ a.toml @ b.toml --section.field value --flag --no-flag --x=1
# --------------------------------------------------------------------------------------------------


def deep_merge(base: dict, update: dict) -> dict:
    """Merge `update` into a copy of `base`, recursing into tables."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e


def _parse_value(text: str) -> Any:
    """Lists and tables come as JSON; everything else (an empty value too) stays a string for pydantic to coerce."""
    if text.startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"could not parse {text!r} as a JSON list/table: {e}") from e
    return text


def _set_path(target: dict, dotted: str, value: Any) -> None:
    keys = dotted.replace("-", "_").split(".")
    for key in keys[:-1]:
        node = target.setdefault(key, {})
        if node == "true":  # `--section` alone, then `--section.field`: the fields fill the section
            node = target[key] = {}
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: {key} is a value, not a table")
        target = node
    current = target.get(keys[-1])
    if isinstance(current, dict):  # `--section.field ...` given before: the section is a table already
        if isinstance(value, dict):
            value = deep_merge(current, value)
        elif value == "true":  # `--section` alone only turns on what the fields turned on
            return
        else:
            raise ConfigError(f"--{dotted} {value} conflicts with the --{dotted}.* settings given before it")
    target[keys[-1]] = value


def parse_argv(argv: list[str], sections: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Split argv into (TOML layer, CLI layer). `--<section> @ file.toml` loads a file into a section."""
    toml_data: dict = {}
    cli_data: dict = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "@" or token.startswith("@"):
            path = token[1:] or (argv[i + 1] if i + 1 < len(argv) else None)
            if not path:
                raise ConfigError("'@' must be followed by a TOML file path")
            toml_data = deep_merge(toml_data, load_toml(path))
            i += 1 if token != "@" else 2
            continue
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: expected '@ file.toml' or '--field value'")
        key, has_value, value = token[2:].partition("=")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if key in sections and not has_value and nxt is not None and (nxt == "@" or nxt.startswith("@")):
            path = argv[i + 2] if nxt == "@" and i + 2 < len(argv) else nxt[1:]
            if not path:
                raise ConfigError(f"--{key} @ must be followed by a TOML file path")
            toml_data = deep_merge(toml_data, {key.replace("-", "_"): load_toml(path)})
            i += 3 if nxt == "@" else 2
            continue
        if has_value:
            _set_path(cli_data, key, _parse_value(value))
            i += 1
        elif nxt is None or nxt.startswith("--") or nxt.startswith("@"):
            flag, negated = (key[3:], True) if key.startswith("no-") else (key, False)
            _set_path(cli_data, flag, "false" if negated else "true")
            i += 1
        else:
            _set_path(cli_data, key, _parse_value(nxt))
            i += 2
    return toml_data, cli_data


C = TypeVar("C", bound=Settings)


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "<root>"
        hint = " (unknown field: check its spelling or see --help)" if item["type"] == "extra_forbidden" else ""
        if item.get("input") == "true" and item["type"] != "extra_forbidden":
            hint = " (a flag given without a value reads as true: was its value left out?)"
        lines.append(f"  {field}: {item['msg']}{hint}")
    return "invalid configuration:\n" + "\n".join(lines)


def build_config(cls: type[C], toml_data: dict, cli_data: dict) -> C:
    token = _toml_layer.set((cls, toml_data))
    try:
        config = cls(**cli_data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    finally:
        _toml_layer.reset(token)
    given = deep_merge(deep_merge(toml_data, EnvSettingsSource(cls)()), cli_data)
    _keep_given_fields_set(config, given)
    return config


def _keep_given_fields_set(config: BaseModel, given: dict) -> None:
    """A section given in part is built from its default instance (nested_model_default_partial_update, so a
    default like SFT's `optim` keeps its other values), which marks every field of it as set; keep only those
    the files, environment or command line gave (the launcher refuses a shared value contradicting a set one)."""
    for name in type(config).model_fields:
        section, part = getattr(config, name), given.get(name)
        if isinstance(section, BaseModel) and isinstance(part, dict):
            section.__pydantic_fields_set__.intersection_update(part)
            _keep_given_fields_set(section, part)


def parse_config(cls: type[C], argv: list[str] | None = None) -> C:
    """Build `cls` from argv (defaults to sys.argv[1:])."""
    argv = sys.argv[1:] if argv is None else argv
    toml_data, cli_data = parse_argv(argv, sections=tuple(getattr(cls, "file_sections", ())))
    return build_config(cls, toml_data, cli_data)


def run_cli(cls: type[C], argv: list[str] | None = None) -> C:
    """Parse a process config from the command line; print help or a clean error and exit on misuse."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(f"usage: {Path(sys.argv[0]).name} [@ config.toml ...] [--section.field value ...]\n")
        print(config_help(cls))
        sys.exit(0)
    try:
        config = parse_config(cls, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    warn_secrets_on_command_line(config, argv, Path(sys.argv[0]).name)
    return config


def to_toml(config: BaseModel, mask_secrets: bool = False) -> str:
    """Serialise a config so that `@ file.toml` reproduces it (None fields are left out), its secrets included (for
    the 0600 file its process reads it back from: write_config); `mask_secrets`: every secret masked, for printing."""
    data = config.model_dump(mode="json", exclude_none=True, context=None if mask_secrets else {WITH_SECRETS: True})
    return tomli_w.dumps(without_secrets(data, drop=False) if mask_secrets else data)


def warn_secrets_on_command_line(config: BaseModel, argv: list[str], program: str) -> None:
    """A secret given as a flag is in the process's command line, which every user of the host can read (`ps`,
    /proc/<pid>/cmdline) for as long as it runs: warned about (as `docker login --password` and `mysql -p` do), not
    refused, for it is already out when this runs; the docs give secrets by environment or in a file."""
    _, cli_data = parse_argv(argv, sections=tuple(getattr(type(config), "file_sections", ())))
    names = secrets_on_command_line(config, cli_data)
    if not names:
        return
    flags = ", ".join(sorted({"--" + name.partition("[")[0].replace("_", "-") for name in names}))
    prefix = type(config).model_config.get("env_prefix", "")
    variables = [prefix + name.replace(".", "__").upper() for name in names if "[" not in name]
    where = f"the environment ({', '.join(variables)}) or " if variables else ""
    print(f"{program}: warning: {flags} puts a secret on the command line, which every user of this host can read "
          f"(ps, /proc/<pid>/cmdline); give it in {where}a TOML file only you can read (@ secrets.toml)",
          file=sys.stderr)


def write_config(config: BaseModel, path: Path, mask_secrets: bool = False) -> None:
    """Write the config readable by its owner only: resolved configs carry their process's secrets. `mask_secrets`:
    for a record of the config that nothing reads back (see to_toml)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write_text(path, to_toml(config, mask_secrets), private=True)
