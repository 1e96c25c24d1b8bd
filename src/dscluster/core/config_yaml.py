"""Typed dataclasses from YAML: a mapping node or a `dotted.key=value` override becomes field values
of the declared types, or a UsageError naming FILE:LINE (or the override) and the valid keys.

Generic over the dataclasses it is given: the training config's own fields, defaults and ranges
live in config.py, which calls this.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any

import yaml

from dscluster.errors import UsageError


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(value: Any, tp: Any, where: str, key: str, written: str | None = None) -> Any:
    """Convert a YAML/override value to the field's declared type, or raise UsageError (ranges and
    choices are `validate`'s, so that a value is judged alike whether it came from a file or not).

    `written` is the scalar as typed: YAML 1.1 reads off/on/yes/no as booleans, and a string
    field such as sync_debug must get 'off', not 'false'."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where, key, written)
            except UsageError as e:
                errors.append(str(e))
        names = " or ".join("null" if a is type(None) else "a mapping" if typing.get_origin(a) is dict
                            else getattr(a, "__name__", str(a)) for a in args)
        raise UsageError(f"{where}: {key} must be {names}, got {value!r}")
    if origin is dict:  # a free-form section (deepspeed:), checked by validate, not typed here
        if not isinstance(value, dict):
            raise UsageError(f"{where}: {key} must be a mapping such as {{tensorboard: {{enabled: true}}}}, "
                             f"got {value!r}")
        return copy.deepcopy(value)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UsageError(f"{where}: {key} must be a list such as [1, 2], got {value!r}")
        return [coerce(v, inner, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            out = value.lower() in ("true", "yes", "on", "1")
        else:
            raise UsageError(f"{where}: {key} must be true or false, got {value!r}")
    elif tp in (int, float):  # a bool is an int to Python, never a number to the user
        accepted, what = ((int, str), "a whole number") if tp is int else ((int, float, str), "a number")
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise UsageError(f"{where}: {key} must be {what}, got {value!r}")
        try:
            out = tp(value)
        except ValueError:
            raise UsageError(f"{where}: {key} must be {what}, got {value!r}") from None
    elif tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise UsageError(f"{where}: {key} must be a string, got {value!r}")
        out = (str(value) if written is None else written).lower() if isinstance(value, bool) else str(value)
    else:
        raise UsageError(f"{where}: {key}: unsupported type {tp}")
    return out


def from_node(cls, node: yaml.Node, path: str, section: str, lines: dict[str, int] | None = None):
    """Build dataclass `cls` from a YAML mapping node, checking every key against its fields.

    `lines` collects dotted key → line number, so later range checks can say where."""
    lines = {} if lines is None else lines
    if not isinstance(node, yaml.MappingNode):
        raise UsageError(f"{path}:{node.start_mark.line + 1}: {section or 'the config'} "
                         "must be a mapping of key: value")
    fields, hints = _fields(cls), _hints(cls)
    kwargs: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for knode, vnode in node.value:
        key = knode.value
        line = knode.start_mark.line + 1
        where = f"{path}:{line}"
        dotted = f"{section}.{key}" if section else key
        if key not in fields:
            raise UsageError(
                f"{where}: unknown key {dotted!r}; valid keys{' in ' + section if section else ''}: "
                f"{', '.join(fields)}"
            )
        if key in seen:
            raise UsageError(f"{where}: {dotted!r} given twice (first on line {seen[key]})")
        seen[key] = line
        lines[dotted] = line
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_node(tp, vnode, path, dotted, lines)
        else:
            value = yaml.safe_load(yaml.serialize(vnode))
            kwargs[key] = coerce(value, tp, where, dotted, vnode.value if isinstance(vnode, yaml.ScalarNode) else None)
    return cls(**kwargs)


def apply_override(cfg: Any, text: str) -> str:
    """Apply one `dotted.key=value` override (value parsed as YAML, then typed); returns the dotted key."""
    where = f"override {text!r}"
    if "=" not in text:
        raise UsageError(f"{where}: expected key=value, e.g. optim.lr=0.0005 or epochs=5")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        fields = _fields(type(obj))
        if part not in fields:
            prefix = ".".join(parts[:i])
            raise UsageError(
                f"{where}: unknown key {key!r}; valid keys{' in ' + prefix if prefix else ''}: {', '.join(fields)}"
            )
        tp = _hints(type(obj))[part]
        if _is_mapping(tp) and i < len(parts) - 1:
            return _override_in_mapping(obj, parts, i, raw, where)
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                raise UsageError(f"{where}: {key!r} is a section; set one of its keys, "
                                 f"e.g. {key}.{next(iter(_fields(tp)))}=...")
            obj = getattr(obj, part)
            continue
        if i != len(parts) - 1:
            raise UsageError(f"{where}: {'.'.join(parts[:i + 1])!r} is not a section")
        setattr(obj, part, coerce(_yaml_value(raw), tp, where, key, raw.strip()))
    return ".".join(parts)


def _yaml_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _is_mapping(tp: Any) -> bool:
    return any(typing.get_origin(a) is dict for a in (tp, *typing.get_args(tp)))


def _override_in_mapping(obj: Any, parts: list[str], i: int, raw: str, where: str) -> str:
    """`deepspeed.zero_optimization.offload_optimizer.device=cpu`: one value inside a mapping field,
    making the mappings on the way. Returns the key of the top-level entry it changed."""
    mapping = getattr(obj, parts[i]) or {}
    inner = mapping
    for depth in range(i + 1, len(parts) - 1):
        inner = inner.setdefault(parts[depth], {})
        if not isinstance(inner, dict):
            raise UsageError(f"{where}: {'.'.join(parts[:depth + 1])} is {inner!r}, not a mapping")
    inner[parts[-1]] = _yaml_value(raw)
    setattr(obj, parts[i], mapping)
    return ".".join(parts[:i + 2])
