"""``load_config``: from a source to a validated, resolved, frozen :class:`DscoreConfig`.

Steps, all problems of one config reported together in one :class:`~dscore.errors.ConfigError`:

1. read the source (:mod:`dscore.config.loader`);
2. build the full model from the registry (:func:`dscore.config.model.build_config_model`);
3. migrate legacy forms with warnings (:mod:`dscore.config.legacy`);
4. drop or refuse keys of features dscore does not implement (:mod:`dscore.config.keys`);
5. find ``"auto"`` values (:mod:`dscore.config.auto`) and resolve the batch triangle
   (:mod:`dscore.config.batch`);
6. validate ``optimizer.params`` / ``scheduler.params`` with the selected plugin's model;
7. validate everything with pydantic (unknown keys are errors, or warnings when not strict);
8. cross-section checks (:mod:`dscore.config.checks`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from dscore.config.auto import scan_auto
from dscore.config.batch import BATCH_KEYS, resolve_batch
from dscore.config.checks import cross_check
from dscore.config.components import validate_components
from dscore.config.errors import Problem, format_path, problems_from_validation, raise_problems
from dscore.config.field_policy import apply_field_policies
from dscore.config.keys import DEEPSPEED_KEYS
from dscore.config.legacy import apply_key_policies, migrate_sections
from dscore.config.loader import read_source
from dscore.config.model import DscoreConfig, _copy_json, build_config_model
from dscore.errors import ConfigError, DscoreError

if TYPE_CHECKING:
    from dscore.registry import Registry

__all__ = ["load_config"]

log = logging.getLogger("dscore.config")

_MAX_LENIENT_PASSES = 16


def _check_keys(value: Any, keys: tuple[Any, ...], source: str) -> None:
    """JSON objects have string keys; a Python dict passed in might not."""
    if isinstance(value, dict):
        for key, sub in value.items():
            if not isinstance(key, str):
                path = format_path(keys) or "<config>"
                raise ConfigError(
                    f"{source}: {path}: keys must be strings, got {key!r} ({type(key).__name__})",
                    path=format_path(keys),
                    source=source,
                )
            _check_keys(sub, (*keys, key), source)
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            _check_keys(sub, (*keys, index), source)


def _default_registry(data: dict[str, Any]) -> Any:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    plugins = data.get("plugins")
    disable = plugins.get("disable") if isinstance(plugins, dict) else None
    names = [n for n in disable if isinstance(n, str)] if isinstance(disable, list) else []
    return Registry(create_plugin_manager(disable=names))


def _disabled_sections(registry: Registry) -> dict[str, list[Any]]:
    """Lower-case section key -> the disabled plugins that would register it (empty when none is
    disabled: the usual case costs nothing)."""
    manager = registry.manager
    found: dict[str, list[Any]] = {}
    for record in manager.disabled_records():
        for spec in manager.disabled_specs(record):
            if spec.kind == "config_section":
                for name in spec.all_names():
                    found.setdefault(name.lower(), []).append(record)
    return found


def _selected_zero_stage(cfg: DscoreConfig, registry: Registry) -> str | None:
    """The ZeRO stage spec name ``initialize`` will pick (an unknown implementation was already a problem)."""
    zero = cfg.section("zero_optimization", None)
    if zero is None:
        return None
    try:
        return registry.zero_stage(cfg.zero_stage, implementation=getattr(zero, "implementation", None)).name
    except DscoreError:
        return None


def _explain_disabled_section(problem: Problem, registry: Registry) -> Problem:
    """An unknown top-level key that an installed but disabled plugin registers as its section says so
    (and how to enable the plugin) instead of only "unknown key"."""
    path, message, keys = problem
    if len(keys) != 1 or ": unknown key" not in message:
        return problem
    disabled = registry.manager.disabled_providers("config_section", str(keys[0]))
    if not disabled:
        return problem
    from dscore.registry import disabled_message

    return path, f"{path}: unknown key: " + disabled_message("config_section", repr(keys[0]), disabled), keys


def _delete(data: Any, keys: tuple[Any, ...]) -> bool:
    node = data
    for key in keys[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(node, dict) and keys and keys[-1] in node:
        del node[keys[-1]]
        return True
    return False


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    out: list[Problem] = []
    for problem in problems:
        if problem[0] in seen:
            continue
        seen.add(problem[0])
        out.append(problem)
    return out


def load_config(
    source: Any,
    *,
    world_size: int = 1,
    registry: Registry | None = None,
    strict: bool | None = None,
    source_name: str | None = None,
    world_size_source: str | None = None,
) -> DscoreConfig:
    """Load, migrate, validate and resolve a ds_config.

    Args:
        source: a dict, a ``str`` or :class:`pathlib.Path` path to a JSON/Hjson file, url-safe base64
            text, or an :class:`argparse.Namespace` carrying ``deepspeed_config`` (or the deprecated
            ``deepscale_config``).
        world_size: data-parallel world size used for the batch triangle (int > 0).
        registry: a :class:`dscore.registry.Registry`; ``None`` builds one from the installed plugins with
            the config's own ``plugins.disable``.
        strict: False turns unknown-key errors into warnings; ``None`` uses the config's ``strict``
            (default true).
        source_name: name of the source in messages (default: the path, ``"<dict>"`` or ``"<base64>"``).
        world_size_source: where ``world_size`` came from, shown in batch errors (default
            ``"world_size=N passed to load_config"``).

    Returns:
        A frozen :class:`DscoreConfig` (a registry-specific subclass) with the batch triangle resolved,
        ``warnings``, ``raw`` and ``source_name`` set. Model-dependent ``"auto"`` values stay pending
        (``pending_auto``) until :meth:`DscoreConfig.resolve_model_auto`.

    Raises:
        ConfigError: every problem found, listed in one error (``errors`` holds ``(path, message)`` pairs,
            ``path`` is the first one's dotted key path).
        PluginConflictError / PluginLoadError: the plugins registering sections or the selected optimizer
            / scheduler are in conflict or broken.
    """
    data, name, warnings = read_source(source, source_name=source_name)
    _check_keys(data, (), name)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}", source=name)
    ws_source = world_size_source or f"world_size={world_size} passed to load_config"

    def warn(message: str) -> None:
        warnings.append(message)
        log.warning("%s: %s", name, message)

    for message in warnings:
        log.warning("%s", message)
    if registry is None:
        registry = _default_registry(data)
    model_cls, sections = build_config_model(registry)

    problems: list[Problem] = migrate_sections(data, sections, warn)
    raw = _copy_json(data)
    problems += apply_key_policies(data, sections, warn)

    strict_value = data.get("strict", True)
    lenient = strict is False or (strict is None and strict_value is False)

    pending, auto_problems = scan_auto(data, model_cls)
    problems += auto_problems

    batch_ok = False
    try:
        batch = resolve_batch(data, world_size=world_size, world_size_source=ws_source, source=name)
    except ConfigError as exc:
        prefix = f"{name}: "
        problems += [(p, m[len(prefix) :] if m.startswith(prefix) else m, (p,)) for p, m in exc.errors]
        for key in BATCH_KEYS:
            data[key] = 1  # placeholders so validation reports only the other problems
    else:
        batch_ok = True
        data.update(
            train_batch_size=batch.train_batch_size,
            train_micro_batch_size_per_gpu=batch.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=batch.gradient_accumulation_steps,
        )
        if batch.derived:
            log.debug(
                "%s: batch triangle: train_batch_size=%d, train_micro_batch_size_per_gpu=%d, "
                "gradient_accumulation_steps=%d (derived %s; world size %d)",
                name,
                batch.train_batch_size,
                batch.train_micro_batch_size_per_gpu,
                batch.gradient_accumulation_steps,
                ", ".join(batch.derived),
                world_size,
            )

    problems += validate_components(data, registry, warn)

    known_top = sorted(DEEPSPEED_KEYS | {k for info in sections.values() for k in info.spec.all_names()})
    cfg: DscoreConfig | None = None
    for attempt in range(_MAX_LENIENT_PASSES):
        try:
            cfg = model_cls.model_validate(data)
            break
        except ValidationError as exc:
            found = problems_from_validation(exc, data, model_cls, extra_known=known_top)
            found = [_explain_disabled_section(p, registry) for p in found]
            unknown = [p for p in found if ": unknown key" in p[1]]
            removable = [p for p in unknown if _delete(data, p[2])] if lenient else []
            if not lenient or not removable or attempt == _MAX_LENIENT_PASSES - 1:
                problems += found
                break
            for _path, message, _keys in removable:
                warn(f"{message} (ignored because strict is false)")
    if cfg is not None:
        problems += cross_check(cfg, registry)
        problems += apply_field_policies(cfg, warn)
    raise_problems(_dedupe(problems), source=name)
    assert cfg is not None and batch_ok  # a failed batch triangle left a problem, raised above
    cfg._warnings = warnings
    cfg._source_name = name
    cfg._raw = raw
    cfg._pending_auto = tuple(pending)
    cfg._world_size = world_size
    cfg._disabled_sections = _disabled_sections(registry)
    cfg._zero_implementation = _selected_zero_stage(cfg, registry)
    return cfg
