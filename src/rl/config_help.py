"""`--help` for a config: one line per field, with its default and description; a tagged union's variants each with
their own fields, a list of tables with each table's."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def config_help(cls: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = ()) -> str:
    """One line per field: --dotted.name (type, default): description; a tagged union's variants each list
    their own fields."""
    lines = []
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        variants, tag = _tagged_union(field)
        if variants:  # a tagged union: each variant's fields under its tag
            if field.default is None:  # an optional one: off unless given
                lines.append(f"  --{prefix}{name}  [off]  {field.description or ''}")
            default = getattr(field.get_default(call_default_factory=True), tag, None)
            tags = [v.model_fields[tag].default for v in variants]
            lines.append(f"  --{prefix}{name}.{tag}  [{default!r}]  {field.description or ''}: one of "
                         + ", ".join(map(repr, tags)))
            for variant, value in zip(variants, tags):
                own = config_help(variant, f"{prefix}{name}.", skip=(tag,))
                own = "\n".join("    " + line for line in own.splitlines())
                lines.append(f"    with {tag} = {value!r}:" + (f"\n{own}" if own else " no other fields"))
            continue
        section = _section_type(field.annotation)
        if section is not None:
            if field.default is None:  # an optional section: `--name` alone turns it on
                lines.append(f"  --{prefix}{name}  [off]  {field.description or ''}")
            lines.append(config_help(section, f"{prefix}{name}."))
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        lines.append(f"  --{prefix}{name}  [{default}]  {field.description or ''}")
        table = _table_type(field.annotation)
        if table is not None:  # a list of tables (TOML [[name]]): each table's fields
            lines.append(f"    each [[{name}]] table:")
            lines += ["    " + line.replace("--", "", 1) for line in config_help(table).splitlines()]
    return "\n".join(lines)


def _table_type(annotation: Any) -> type[BaseModel] | None:
    """The config class of a list of tables (`list[X]`), else None."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) is list else ()
    return args[0] if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel) else None


def _tagged_union(field: FieldInfo) -> tuple[list[type[BaseModel]], str | None]:
    """The variants of a tagged union of sections and their tag (`A | B` with a discriminator, optional or not)."""
    if field.discriminator:
        return _union_sections(field.annotation), field.discriminator
    args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Annotated:  # `Annotated[A | B, Field(...)] | None`
        union, *metadata = typing.get_args(args[0])
        tags = [m.discriminator for m in metadata if isinstance(m, FieldInfo) and m.discriminator]
        if tags:
            return _union_sections(union), tags[0]
    return [], None


def _union_sections(annotation: Any) -> list[type[BaseModel]]:
    """The config classes of a union of several sections (`A | B | C`), else []."""
    models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models if len(models) > 1 else []


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The config class of a section field (`X` or `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and type(None) in args else None
