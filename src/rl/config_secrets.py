"""Secrets in configs: declared as such (`Secret`), so that every dump and repr of a config shows SECRET_MASK for
them, but the one its process reads back (rl/config.py: `to_toml`, `write_config`)."""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, get_args
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, SerializationInfo
from pydantic.fields import FieldInfo


SECRET_MASK = "<hidden>"
WITH_SECRETS = "with_secrets"  # in a dump's context: the real values (to_toml, for the 0600 file a process reads)


class _SecretMarker:
    def __repr__(self) -> str:
        return "Secret"


SECRET = _SecretMarker()
Secret = Annotated[str, SECRET]
"""A secret (a token, a key, the run's secret): the code that uses it reads the value; every dump and repr of its
config (Section, Settings) shows SECRET_MASK instead. Declare the field `Annotated[Secret | None, Field(...)]`."""

# Secret fields found by name too: a field so named but not declared `Secret` is hidden all the same, and so are
# these keys in a dump that is no config's (without_secrets).
SECRET_FIELDS = ("admin_token", "api_key", "secret")


def is_secret(name: str, field: FieldInfo) -> bool:
    """Whether a config field holds a secret: declared `Secret`, or named as one (SECRET_FIELDS)."""
    def marked(annotation: Any) -> bool:
        return any(arg is SECRET or marked(arg) for arg in get_args(annotation))

    return name in SECRET_FIELDS or any(m is SECRET for m in field.metadata) or marked(field.annotation)


@cache
def secret_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in cls.model_fields.items() if is_secret(name, field))


def public_config(config: BaseModel) -> dict:
    """The config as W&B and any other record outside the run's 0600 files get it: every secret masked (it still
    shows which are set), and the password of every URL."""
    return without_secrets(config.model_dump(mode="json"), drop=False)


SECRET_FLAG_WORDS = frozenset({"token", "key", "secret", "password"})  # a word of a flag's name: `--hf-token`


def args_without_secrets(args: list[str]) -> list[str]:
    """A command line's arguments (vLLM's `extra_args`, a process's command) with the value of every flag whose name
    has a secret's word masked: `--hf-token X`, `--hf-token=X` (not `--max-num-batched-tokens`)."""
    masked, hide_next = [], False
    for arg in args:
        name, equals, _ = arg.partition("=")
        if hide_next and not arg.startswith("-"):
            masked.append(SECRET_MASK)
        elif name.startswith("-") and names_a_secret(name.lstrip("-")):
            masked.append(f"{name}={SECRET_MASK}" if equals else arg)
            hide_next = not equals
            continue
        else:
            masked.append(arg)
        hide_next = False
    return masked


# An environment's tables rl passes on unread ([[env]] args, harness, runtime, overrides): their keys are the
# environment's, so a secret among them is found by a word of its name (`judge_api_key`, `hf_token`).
FREE_FORM_TABLES = frozenset({"args", "harness", "runtime", "overrides"})


def names_a_secret(key: str) -> bool:
    return bool(SECRET_FLAG_WORDS & set(key.lower().replace("-", "_").split("_")))


def free_form_without_secrets(data: Any, drop: bool) -> Any:
    """A free-form table with the value of every key that names a secret masked (or dropped), at any depth."""
    if isinstance(data, list):
        return [free_form_without_secrets(v, drop) for v in data]
    if not isinstance(data, dict):
        return without_secrets(data, drop)
    public = {}
    for key, value in data.items():
        if not names_a_secret(str(key)) or isinstance(value, (dict, list)):
            public[key] = free_form_without_secrets(value, drop)
        elif not drop:
            public[key] = None if value is None else SECRET_MASK
    return public


def without_secrets(data: Any, drop: bool) -> Any:
    """A config dump (nested dicts and lists) with every secret field that holds a value masked (`SECRET_MASK`:
    printed, it still shows the field is set) or dropped (`drop`: for a file that must not carry it), and the
    password of every URL masked (a URL without it would name another server)."""
    if isinstance(data, str):
        return url_without_password(data)
    if isinstance(data, list):
        return [without_secrets(v, drop) for v in data]
    if not isinstance(data, dict):
        return data
    public = {}
    for key, value in data.items():
        if key == "extra_args" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            public[key] = args_without_secrets(value)
        elif key in FREE_FORM_TABLES and isinstance(value, dict):
            public[key] = free_form_without_secrets(value, drop)
        elif key not in SECRET_FIELDS:
            public[key] = without_secrets(value, drop)
        elif not drop:
            public[key] = None if value is None else SECRET_MASK
    return public


def secrets_on_command_line(config: BaseModel, cli_data: dict, prefix: str = "") -> list[str]:
    """The dotted names of the secret fields of `config` that `cli_data` (the command line's layer) sets."""
    found = []
    for key, value in cli_data.items():
        field = type(config).model_fields.get(key)
        if value is not None and (is_secret(key, field) if field else key in SECRET_FIELDS):
            found.append(prefix + key)
        part = getattr(config, key, None) if field else None
        if isinstance(part, BaseModel) and isinstance(value, dict):
            found += secrets_on_command_line(part, value, f"{prefix}{key}.")
        elif isinstance(part, list) and isinstance(value, list):
            for item, given in zip(part, value):
                if isinstance(item, BaseModel) and isinstance(given, dict):
                    found += secrets_on_command_line(item, given, f"{prefix}{key}[].")
    return found


def url_without_password(text: str) -> str:
    """`scheme://user:password@host/...` with the password masked; any other text as it is."""
    try:
        url = urlsplit(text) if "@" in text else None
    except ValueError:  # not a URL (an unclosed '[' in what would be its host)
        return text
    if url is None or url.password is None:
        return text
    user = url.netloc.rpartition("@")[0].partition(":")[0]
    return urlunsplit(url._replace(netloc=f"{user}:{SECRET_MASK}@{url.netloc.rpartition('@')[2]}"))


def hide_secrets(self, handler, info: SerializationInfo) -> Any:
    """Every dump of a config (model_dump, to_toml, W&B) with each secret field that holds a value as SECRET_MASK,
    unless the dump asks for `WITH_SECRETS` (to_toml, for the 0600 file a process reads its config back from)."""
    data = handler(self)
    if isinstance(data, dict) and not (info.context or {}).get(WITH_SECRETS):
        for name in secret_fields(type(self)):
            if data.get(name) is not None:
                data[name] = SECRET_MASK
    return data


def repr_args_without_secrets(self):
    """repr(config), str(config) (a traceback, an error message, a log line): secrets as SECRET_MASK."""
    hidden = secret_fields(type(self))
    for name, value in BaseModel.__repr_args__(self):
        yield name, SECRET_MASK if name in hidden and value is not None else value
