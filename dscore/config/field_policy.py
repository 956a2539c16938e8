"""Enforce the per-field markers of the config models at load (torch-free).

A field marked :func:`dscore.config.base.no_effect` that the config sets explicitly is a warning naming its
key path and why it changes nothing in dscore; a field marked :func:`dscore.config.base.not_implemented`
set to a value other than its default is a :class:`dscore.errors.ConfigError` problem naming the key path.
Key paths use the spelling DeepSpeed documents (a field's alias when it has one, e.g.
``zero_optimization.stage3_model_persistence_threshold``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from dscore.config.base import field_status
from dscore.config.errors import Problem

__all__ = ["apply_field_policies"]


def _walk(model: BaseModel, prefix: str, keys: tuple[Any, ...]) -> list[tuple[str, tuple[Any, ...], BaseModel, str]]:
    """``(key path, key tuple, owning instance, field name)`` of every set field, depth first."""
    out = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name, None)
        key = field.alias or name
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, BaseModel):
            out += _walk(value, path, (*keys, key))
        elif name in model.model_fields_set:
            out.append((path, (*keys, key), model, name))
    return out


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def apply_field_policies(cfg: BaseModel, warn: Callable[[str], None]) -> list[Problem]:
    """Warn about explicitly set no-effect fields and return a problem per refused non-default value.

    Args:
        cfg: the validated config (any model; nested models are walked).
        warn: receives each warning message.

    Returns:
        ``(path, message, keys)`` problems for :func:`dscore.config.errors.raise_problems`.
    """
    problems: list[Problem] = []
    for path, keys, owner, name in _walk(cfg, "", ()):
        field = type(owner).model_fields[name]
        status = field_status(field)
        if status is None:
            continue
        kind, reason = status
        value = getattr(owner, name)
        default = field.get_default(call_default_factory=True)
        if kind == "warned":
            warn(f"{path} = {_show(value)} has no effect in dscore: {reason}")
        elif value != default:
            problems.append(
                (path, f"{path} = {_show(value)}: not implemented in dscore ({reason}); remove the key or set it "
                 f"to {_show(default)}", keys)
            )
    return problems
