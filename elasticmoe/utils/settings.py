"""Settings declared once: a pydantic model's fields are the CLI flags, a TOML table and Serve args.

A settings model is a frozen, strict pydantic model whose fields carry their help
text as `description`. How a field shows on the command line, when that is not
`--<field-name>`, is said once beside it with `cli(...)`: another flag name, the unit
the flag is given in (`--device-memory-gb` for a field in bytes), an environment
variable for a secret (secrets are flags or variables, never in a file or in the
Serve args that sit in a Kubernetes object), or no flag at all. From the model:

- `add_flags` adds one argparse flag per field, every default None (= not given), so
  a flag given wins over the config file and the file over the model's defaults;
- `flag_values` reads back the flags given, converted to the field's unit;
- `read_toml` reads a config file's tables, refusing tables it does not know;
- `explain` turns a `ValidationError` into one line naming the flag, file key or arg.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, SecretStr

GIB = 1 << 30
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def cli(
    flag: str | None = None,
    *,
    metavar: str | None = None,
    unit: float = 1,
    env: str | None = None,
    none: bool = False,
) -> dict[str, Any]:
    """How a field shows on the command line (`json_schema_extra` of its `Field`).

    `flag`: its name when not `--<prefix><field-name>`; `unit`: flag value x unit = field
    value; `env`: a secret, read from this variable when the flag is not given; `none`: no flag.
    """
    return {"cli": {"flag": flag, "metavar": metavar, "unit": unit, "env": env, "none": none}}


def _meta(field: Any) -> dict[str, Any]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra.get("cli") or {"flag": None, "metavar": None, "unit": 1, "env": None, "none": False}


def flag_name(model: type[BaseModel], name: str, prefix: str = "") -> str:
    """The flag of field `name` (`prefix` is the section's, e.g. `autoscale-`)."""
    return _meta(model.model_fields[name])["flag"] or f"--{prefix}{name.replace('_', '-')}"


def secret_fields(model: type[BaseModel]) -> set[str]:
    """Fields that come only from flags or the environment, never from a file or Serve args."""
    return {name for name, field in model.model_fields.items() if _meta(field)["env"]}


def _base(annotation: Any) -> Any:
    """`int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _is_pairs(annotation: Any) -> bool:
    """tuple[tuple[str, str], ...]: repeatable NAME=VALUE flags."""
    return typing.get_origin(annotation) is tuple and typing.get_origin(typing.get_args(annotation)[0]) is tuple


def _help(name: str, field: Any, meta: dict[str, Any]) -> str:
    text = (field.description or "").replace("%", "%%")  # argparse formats help with %
    if meta["flag"]:  # the flag is not the field's name: say the name the file and the args use
        text += f" [key {name}" + (", in bytes]" if meta["unit"] != 1 else "]")
    default = field.default
    if meta["env"]:
        return f"{text} (default: ${meta['env']}; prefer the variable: a flag shows in the process list)"
    if field.is_required() or default in (None, ()) or "(default" in text or isinstance(default, (bool, BaseModel)):
        return text
    shown = f"{default / meta['unit']:g}" if meta["unit"] != 1 else str(default)
    return f"{text} (default {shown})"


def add_flags(group: Any, model: type[BaseModel], prefix: str = "", skip: frozenset[str] = frozenset()) -> None:
    """One flag per field of `model` (nested models and fields in `skip` excepted)."""
    for name, field in model.model_fields.items():
        meta = _meta(field)
        annotation = _base(field.annotation)
        if meta["none"] or name in skip or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            continue
        kwargs: dict[str, Any] = {"dest": prefix.replace("-", "_") + name, "default": None,
                                  "help": _help(name, field, meta)}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif _is_pairs(field.annotation):
            kwargs.update(action="append", metavar=meta["metavar"] or "NAME=VALUE")
        elif typing.get_origin(annotation) is Literal:
            kwargs.update(choices=list(typing.get_args(annotation)))
        else:
            unit = meta["unit"]
            kind = float if unit != 1 else {int: int, float: float}.get(annotation, str)
            kwargs.update(type=kind, metavar=meta["metavar"] or name.split("_")[-1].upper())
        group.add_argument(flag_name(model, name, prefix), **kwargs)


def flag_values(args: argparse.Namespace, model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """The fields whose flags were given (secrets also from their variable), in the field's unit."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        meta = _meta(field)
        given = getattr(args, prefix.replace("-", "_") + name, None)
        if given is None and meta["env"]:
            given = os.environ.get(meta["env"]) or None
        if given is None:
            continue
        if meta["unit"] != 1:
            given = int(given * meta["unit"])
        values[name] = given
    return values


def read_toml(path: Path, tables: set[str], option: str = "--config") -> dict[str, dict[str, Any]]:
    """The tables of a TOML file; raises `ValueError` naming the file and what is wrong."""
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{option}: {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(document) - tables)
    if unknown:
        raise ValueError(f"{option}: {path}: unknown table(s) {', '.join(unknown)}; known: {', '.join(sorted(tables))}")
    for table, section in document.items():
        if not isinstance(section, dict):
            raise ValueError(f"{option}: {path}: [{table}] must be a table")
    return document


def from_sources(
    model: type[BaseModel],
    args: argparse.Namespace,
    path: str | None,
    table: str,
    *,
    prefix: str = "",
    sections: dict[str, str] | None = None,
    tables: set[str] | None = None,
) -> Any:
    """`model` from its flags, over the `[table]` of the TOML file at `path`, over its defaults.

    `sections`: nested settings fields and their flag prefixes (`{"autoscale": "autoscale-"}`),
    each read from its own table. `tables`: every table the file may hold (default: these).
    Raises `ValueError` whose message names each bad flag, or file and key.
    """
    sections = sections or {}
    document = read_toml(Path(path), tables or {table, *sections}) if path else {}
    names: dict[tuple[Any, ...], str] = {}

    def gather(sub: type[BaseModel], name: str, sub_prefix: str, loc: tuple[Any, ...]) -> dict[str, Any]:
        in_file = dict(document.get(name, {}))
        for key in sorted(set(in_file) & secret_fields(sub)):
            raise ValueError(f"--config {path} [{name}] {key}: secrets go in a flag or "
                             f"${_meta(sub.model_fields[key])['env']}, never in a file")
        given = flag_values(args, sub, sub_prefix)
        for key in in_file:
            names[(*loc, key)] = f"--config {path} [{name}] {key}"
        for key in given:
            names[(*loc, key)] = flag_name(sub, key, sub_prefix)
        return {**in_file, **given}

    values = gather(model, table, prefix, ())
    for field, sub_prefix in sections.items():
        nested = gather(_base(model.model_fields[field].annotation), field, sub_prefix, (field,))
        if nested:
            values[field] = nested
    def name_of(loc: tuple[Any, ...]) -> str:
        if loc in names:
            return names[loc]
        if len(loc) == 1 and loc[0] in model.model_fields:
            return flag_name(model, loc[0], prefix)
        if len(loc) == 2 and loc[0] in sections:
            return flag_name(_base(model.model_fields[loc[0]].annotation), loc[1], sections[loc[0]])
        return ".".join(map(str, loc))

    try:
        return model.model_validate(values)
    except pydantic.ValidationError as exc:
        raise ValueError(explain(exc, name_of)) from None


def explain(error: pydantic.ValidationError, name_of: typing.Callable[[tuple[Any, ...]], str]) -> str:
    """One line per problem, each naming where the value came from (`name_of(loc)`)."""
    lines = []
    for problem in error.errors(include_url=False):
        loc = tuple(problem["loc"])
        kind = problem["type"]
        if kind == "value_error":  # our validators' messages already name the option
            lines.append(str(problem["ctx"]["error"]))
            continue
        where = name_of(loc) if loc else "settings"
        value = problem.get("input")
        # NOTE: only plain values are echoed: never a whole mapping, never a key
        got = f", got {value!r}" if isinstance(value, (int, float, str)) and not str(loc[-1:]).endswith("key',)") else ""
        if kind == "missing":
            lines.append(f"{where}: required")
        elif kind == "extra_forbidden":
            lines.append(f"{where}: unknown option")
        elif kind in _BOUNDS:
            bound = next(iter(problem["ctx"].values()))
            lines.append(f"{where}: must be {_BOUNDS[kind]} {bound}{got}")
        else:
            lines.append(f"{where}: {problem['msg'][0].lower()}{problem['msg'][1:]}{got}")
    return "; ".join(lines)


def reveal(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
