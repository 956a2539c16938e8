"""Turning pydantic validation errors into :class:`~dscore.errors.ConfigError` with dotted key paths.

Paths are written the way the user wrote the keys (aliases included, e.g.
``zero_optimization.stage3_prefetch_bucket_size``), list items as ``[i]``. Unknown keys get a
did-you-mean from the keys valid at that place.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from dscore.errors import ConfigError, did_you_mean

__all__ = ["Problem", "format_path", "short_repr", "model_at", "keys_of", "problems_from_validation", "raise_problems"]

#: ``(dotted path, message, key tuple)``; the message starts with the path.
Problem = tuple[str, str, tuple[Any, ...]]


def format_path(keys: Sequence[Any]) -> str:
    """``("a", "b", 0, "c")`` -> ``"a.b[0].c"``."""
    out = ""
    for key in keys:
        if isinstance(key, int) and not isinstance(key, bool):
            out += f"[{key}]"
        elif not isinstance(key, str) or not key or any(c in key for c in '.[]"') or key != key.strip():
            out += f"[{json.dumps(key) if isinstance(key, str) else repr(key)}]"  # a key that is not dotted-path safe
        else:
            out += f".{key}" if out else key
    return out


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:  # a pathological object: never fail while reporting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None and not isinstance(annotation, types.UnionType):
        return []
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _field_for(model: type[BaseModel], key: Any) -> str | None:
    """The field name ``key`` addresses in ``model`` (by name or alias), or None."""
    if not isinstance(key, str):
        return None
    if key in model.model_fields:
        return key
    for name, info in model.model_fields.items():
        if info.alias == key or info.validation_alias == key:
            return name
    return None


def model_at(model: type[BaseModel] | None, keys: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model validating the dict at ``keys`` under ``model`` (list indices skipped), or None."""
    current = model
    for key in keys:
        if current is None:
            return None
        if isinstance(key, int) and not isinstance(key, bool):
            continue
        name = _field_for(current, key)
        if name is None:
            return None
        found = _models_in(current.model_fields[name].annotation)
        current = found[0] if found else None
    return current


def keys_of(model: type[BaseModel]) -> list[str]:
    """Every key ``model`` accepts: field names and aliases."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        out.append(name)
        if isinstance(info.alias, str) and info.alias != name:
            out.append(info.alias)
    return out


def _user_keys(loc: Sequence[Any], data: Any, kind: str = "") -> tuple[Any, ...]:
    """Keep only the loc parts that are keys/indices of ``data``.

    Pydantic adds union-member tags (``'int'``, ``"literal['auto']"``, ``'function-after[...]'``) to
    locations; they are dropped. A missing key (``kind == "missing"``) keeps its last part.
    """
    keys: list[Any] = []
    node = data
    last = len(loc) - 1
    for index, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            keys.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            keys.append(part)
            node = node[part]
        elif kind == "missing" and index == last and isinstance(node, dict):
            keys.append(part)
        # anything else is a union tag (or a location inside a scalar): not a user key
    return tuple(keys)


def problems_from_validation(
    exc: ValidationError,
    data: Any,
    model: type[BaseModel],
    *,
    prefix: Sequence[Any] = (),
    extra_known: Iterable[str] = (),
) -> list[Problem]:
    """One problem per offending path of a pydantic :class:`ValidationError`.

    Args:
        exc: the error raised by ``model.model_validate(data)``.
        data: the validated input (used to map pydantic's locations to user keys).
        model: the model that was validated (for did-you-mean on unknown keys).
        prefix: keys prepended to every path (``("optimizer", "params")``).
        extra_known: more keys valid at the top of ``model`` (for suggestions only).

    Returns:
        ``(path, message, keys)`` tuples; several pydantic errors for one path (a union) are merged.
    """
    merged: dict[tuple[Any, ...], list[str]] = {}
    kinds: dict[tuple[Any, ...], str] = {}
    inputs: dict[tuple[Any, ...], Any] = {}
    for err in exc.errors(include_url=False):
        kind = err.get("type", "")
        keys = _user_keys(err.get("loc", ()), data, kind)
        if kind == "extra_forbidden":
            parent = model_at(model, keys[:-1])
            choices = keys_of(parent) if parent is not None else []
            if not keys[:-1]:
                choices += list(extra_known)
            close = did_you_mean(str(keys[-1]), choices) if keys else []
            text = "unknown key" + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "")
            if choices and not close and len(set(choices)) <= 20:
                text += f" (valid keys here: {', '.join(sorted(set(choices)))})"
            merged.setdefault(keys, []).append(text)
            kinds[keys] = kind
            continue
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if kind == "missing":
            msg = "required key is missing"
        merged.setdefault(keys, [])
        if msg not in merged[keys]:
            merged[keys].append(msg)
        kinds.setdefault(keys, kind)
        inputs.setdefault(keys, err.get("input"))
    problems: list[Problem] = []
    for keys, messages in merged.items():
        full = (*prefix, *keys)
        path = format_path(full)
        text = " or ".join(messages) if len(messages) > 1 else messages[0]
        if kinds.get(keys) not in {"extra_forbidden", "missing"}:
            text += f" (got {short_repr(inputs.get(keys))})"
        problems.append((path, f"{path or '<config>'}: {text}", full))
    return problems


def raise_problems(problems: list[Problem], *, source: str) -> None:
    """Raise one :class:`ConfigError` listing every problem (no-op when the list is empty)."""
    if not problems:
        return
    if len(problems) == 1:
        message = f"{source}: {problems[0][1]}"
    else:
        lines = "\n".join(f"  - {p[1]}" for p in problems)
        message = f"{source}: {len(problems)} problems in the ds_config:\n{lines}"
    raise ConfigError(message, path=problems[0][0], source=source, errors=[(p[0], p[1]) for p in problems])
