"""Finding ``"auto"`` values: which dscore can resolve, and which are errors.

``"auto"`` is never replaced silently by a default. It is accepted where

* the field declares ``"auto"`` as a value of its own (``data_types.keep_in_fp32_modules``),
* it is one batch key and the other two are concrete (:mod:`dscore.config.batch`),
* the field is model-dependent (``zero_optimization.reduce_bucket_size``, ``stage3_prefetch_bucket_size``,
  ``stage3_param_persistence_threshold``): it stays pending until
  :meth:`dscore.config.DscoreConfig.resolve_model_auto` is given the hidden size,

and reported, all paths at once, everywhere else.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from dscore.config.base import MODEL_AUTO_FORMULAS, is_auto
from dscore.config.errors import Problem, _field_for, format_path, model_at
from dscore.config.model import PendingAuto

__all__ = ["scan_auto"]


def scan_auto(data: dict[str, Any], model: type[BaseModel]) -> tuple[list[PendingAuto], list[Problem]]:
    """Walk ``data`` along ``model``; collect pending model-dependent ``"auto"`` and unresolvable ones.

    Unresolvable ``"auto"`` entries are removed from ``data`` (in place) so validation does not report
    them a second time.

    Returns:
        ``(pending, problems)``.
    """
    pending: list[PendingAuto] = []
    problems: list[Problem] = []

    def walk(node: Any, current: type[BaseModel] | None, keys: tuple[Any, ...], names: tuple[str, ...]) -> None:
        if isinstance(node, list):
            for index, item in enumerate(node):
                if is_auto(item):
                    path = format_path((*keys, index))
                    problems.append((path, f'{path}: unresolved "auto" (dscore cannot derive it)', (*keys, index)))
                else:
                    walk(item, None, (*keys, index), names)
            return
        if not isinstance(node, dict):
            return
        for key in list(node):
            value = node[key]
            field = _field_for(current, key) if current is not None else None
            sub_keys = (*keys, key)
            if is_auto(value):
                rules: dict[str, str] = getattr(current, "dscore_auto", {}) if current is not None else {}
                rule = rules.get(field) if field else None
                if rule in ("value", "batch"):
                    continue
                path = format_path(sub_keys)
                if rule in MODEL_AUTO_FORMULAS:
                    pending.append(PendingAuto(path=path, field_names=(*names, field or str(key)), formula=rule))
                    continue
                problems.append(
                    (
                        path,
                        f'{path}: unresolved "auto": dscore cannot derive this value; write a concrete value '
                        '("auto" is resolved only for the third batch key and for ZeRO bucket sizes from the '
                        "model's hidden size)",
                        sub_keys,
                    )
                )
                del node[key]
                continue
            walk(
                value, model_at(current, [key]) if current is not None else None, sub_keys, (*names, field or str(key))
            )

    walk(data, model, (), ())
    return pending, problems
