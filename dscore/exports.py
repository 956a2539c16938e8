"""User-facing names whose machinery lives in a plugin: thin names resolved through the registry by kind.

DeepSpeed users import ``dscore.parallel.ulysses.UlyssesSPAttentionHF`` or ``dscore.pipe.PipelineModule``
from fixed paths; the code behind them is a plugin unit (a model transform, an engine, ...). Such a path
stays a small core module whose missing attributes resolve, on first access, through the unit's
``exports`` module (:attr:`dscore.specs.ComponentSpec.exports`) as registered in the active registry — the
current runtime's inside ``dscore.initialize`` (so ``plugins.disable`` holds), else one over the installed
plugins. A disabled or missing unit raises the registry's error naming it and how to re-enable it, at the
import of the name, never later. This is how :func:`dscore.ops.get_op_builder` already finds op builders.

Example (a thin module)::

    from dscore.exports import thin_getattr

    __all__ = ["UlyssesSPAttentionHF", "TiledMLP"]
    __getattr__ = thin_getattr(__name__, "model_transform", "ulysses", __all__)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from dscore.registry import Registry

__all__ = ["active_registry", "provided", "thin_getattr"]


def active_registry() -> tuple[Registry, bool]:
    """``(registry, from_runtime)``: the current runtime's registry (``plugins.disable`` holds) or, outside
    ``initialize``, a fresh one over the installed plugins (``DSCORE_DISABLE_PLUGINS`` holds)."""
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    if runtime is not None:
        return runtime.registry, True
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    return Registry(create_plugin_manager()), False


def provided(kind: str, name: str, attr: str, *, public_name: str = "") -> Any:
    """The object ``attr`` of the ``exports`` module of the active ``kind`` unit ``name``.

    Args:
        kind: a spec kind (``"model_transform"``).
        name: the unit's name (``"ulysses"``).
        attr: the attribute of its exports module (``"UlyssesSPAttentionHF"``).
        public_name: the dotted name the user imported, for messages.

    Raises:
        ComponentNotFoundError / PluginLoadError / PluginConflictError: the unit is missing, disabled,
            broken or provided twice (the registry's messages: how to re-enable it).
        PluginValidationError: the unit declares no ``exports`` module.
        AttributeError: its exports module has no ``attr``.
    """
    from dscore.errors import PluginLoadError, PluginValidationError

    registry, _ = active_registry()
    spec = registry.get(kind, name, config_path=public_name)
    if not spec.exports:
        record = registry.provider(spec)
        raise PluginValidationError(
            f"{public_name or attr} is provided by the {kind} unit {spec.name!r} of plugin {record.label()}, "
            "but that spec declares no exports module"
        )
    try:
        module = importlib.import_module(spec.exports)
    except Exception as exc:  # noqa: BLE001 - the plugin's module failing to import is the plugin's
        record = registry.provider(spec)
        raise PluginLoadError(
            f"plugin {record.label()}: the exports module {spec.exports!r} of {kind} {spec.name!r} cannot be "
            f"imported ({type(exc).__name__}: {exc}); disable it with DSCORE_DISABLE_PLUGINS={kind}:{spec.name}",
            plugin=record.name,
            distribution=record.distribution,
            version=record.version,
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(
            f"{public_name or attr}: the {kind} unit {spec.name!r} ({spec.exports}) has no attribute {attr!r}"
        ) from None


def thin_getattr(module_name: str, kind: str, name: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module_name`` that resolves each of ``names`` through
    :func:`provided` on first access and keeps it in the module (later accesses are plain lookups).

    Raises (from the returned function):
        AttributeError: ``attr`` is not one of ``names``.
        as :func:`provided` for one of ``names``.
    """
    wanted = frozenset(names)

    def __getattr__(attr: str) -> Any:
        if attr not in wanted:
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        value = provided(kind, name, attr, public_name=f"{module_name}.{attr}")
        setattr(sys.modules[module_name], attr, value)
        return value

    return __getattr__
