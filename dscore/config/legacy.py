"""Legacy forms and keys dscore does not implement, handled before validation.

* A section registered with aliases (``bf16`` with alias ``bfloat16``): the alias is moved to the
  canonical key with a warning naming it; when both are given the canonical key wins and the alias is
  dropped with a warning (DeepSpeed reads ``bfloat16`` only when ``bf16`` is absent).
* A section model's ``migrate_legacy`` classmethod rewrites its own old forms (``"zero_optimization":
  true``, ``cpu_offload``, ...); see :mod:`dscore.config.base`.
* Top-level keys of removed or unimplemented DeepSpeed features (:mod:`dscore.config.keys`): dropped
  with a warning when they have no effect, refused when they would change training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dscore.config.errors import Problem
from dscore.config.keys import GATED_KEYS, IGNORED_KEYS, PLUGIN_SECTION_KEYS, KeyPolicy, effect_of
from dscore.config.model import CORE_KEYS, SectionInfo
from dscore.errors import ConfigError

__all__ = ["migrate_sections", "apply_key_policies"]

Warn = Callable[[str], None]


def migrate_sections(data: dict[str, Any], sections: Mapping[str, SectionInfo], warn: Warn) -> list[Problem]:
    """Rewrite legacy aliases and forms of registered sections in ``data`` (in place).

    Returns:
        Problems for forms a section's ``migrate_legacy`` refused (a :class:`ConfigError` it raised).
    """
    problems: list[Problem] = []
    for key, info in sections.items():
        for alias in info.spec.aliases:
            if alias not in data:
                continue
            if key in data:
                warn(f"{alias!r} is a legacy spelling of {key!r}; both are given, so {alias!r} is ignored")
                del data[alias]
            else:
                warn(f"{alias!r} is deprecated; use {key!r} (migrated)")
                data[key] = data.pop(alias)
        migrate = getattr(info.model, "migrate_legacy", None)
        if key in data and callable(migrate):
            try:
                data[key] = migrate(data[key], root=data, warn=warn)
            except ConfigError as exc:
                for path, message in exc.errors:
                    problems.append((path or key, message, tuple(path.split(".")) if path else (key,)))
    return problems


def _gate(key: str, value: Any, policy: KeyPolicy, warn: Warn) -> Problem | None:
    reason = effect_of(policy, key, value)
    if reason is None:
        why = "removed in DeepSpeed 0.19.8" if policy.removed else "not implemented by dscore"
        warn(f"{key!r} ({policy.feature}, {why}) has no effect as written and is ignored")
        return None
    if policy.removed:
        text = (
            f"{key}: {policy.feature} was removed in DeepSpeed 0.19.8 and dscore does not implement it, but "
            f"this block would change training ({reason}). Remove the {key!r} block or disable it."
        )
    else:
        text = (
            f"{key}: dscore does not implement {policy.feature}, but this block would change training "
            f"({reason}). Remove the {key!r} block or disable it."
        )
    return (key, text, (key,))


def apply_key_policies(data: dict[str, Any], sections: Mapping[str, SectionInfo], warn: Warn) -> list[Problem]:
    """Drop (with a warning) or refuse top-level keys dscore does not implement (``data`` edited in place).

    A key the core defines or a registered section owns is left alone, even if it is listed in
    :mod:`dscore.config.keys` (a plugin may implement a feature the built-ins lack).

    Returns:
        One problem per refused key.
    """
    problems: list[Problem] = []
    for key in list(data):
        if key in CORE_KEYS or key in sections:
            continue
        policy = GATED_KEYS.get(key) or PLUGIN_SECTION_KEYS.get(key)
        if policy is not None:
            if key in PLUGIN_SECTION_KEYS:
                policy = KeyPolicy(
                    f"{policy.feature} (no active plugin registers the {key!r} section)", False, policy.effect
                )
            problem = _gate(key, data[key], policy, warn)
            if problem is None:
                del data[key]
            else:
                problems.append(problem)
                del data[key]
            continue
        if key in IGNORED_KEYS:
            warn(f"{key!r} is ignored by dscore: {IGNORED_KEYS[key]}")
            del data[key]
    return problems
