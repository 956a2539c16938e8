"""C++/CUDA ops: the :class:`OpBuilder` base, its build cache and the registry lookup of builders.

Nothing here probes a compiler or imports torch at import time; builds happen on ``load()``. Op
builders themselves are plugins (``dscore_register_op_builders``); the built-in ones live in
``dscore_plugins.ops``.

Example::

    from dscore.ops import get_op_builder
    cpu_adam = get_op_builder("cpu_adam").load()   # JIT-builds into the cache on first use
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dscore.errors import OpBuildError
from dscore.ops.builder import CPUOpBuilder, CUDAOpBuilder, OpBuilder, cache_root

if TYPE_CHECKING:  # pragma: no cover
    from dscore.registry import Registry

__all__ = ["OpBuilder", "CPUOpBuilder", "CUDAOpBuilder", "cache_root", "get_op_builder", "op_builder_class"]


def _active_registry() -> tuple[Registry, bool]:
    from dscore.exports import active_registry

    return active_registry()


def op_builder_class(name: str, registry: Registry | None = None) -> type[OpBuilder]:
    """Return the :class:`OpBuilder` subclass registered under ``name`` (case-insensitive, aliases too).

    Args:
        name: op name (``"cpu_adam"``).
        registry: the registry to search; default: the current runtime's (inside ``dscore.initialize`` and
            training, so a plugin disabled by ``plugins.disable`` stays disabled), else — outside any
            runtime, e.g. in the CLI — one over the installed plugins.

    Raises:
        ComponentNotFoundError / PluginLoadError: no active plugin registers ``name`` (lists what exists and,
            when plugins are disabled in this run, names them: one of them may be the provider).
        OpBuildError: the registered import string does not resolve to an ``OpBuilder`` subclass.
    """
    from dscore.errors import ComponentNotFoundError
    from dscore.specs import OpBuilderSpec, resolve

    from_runtime = False
    if registry is None:
        registry, from_runtime = _active_registry()
    try:
        spec = registry.get_typed(OpBuilderSpec, name)
    except ComponentNotFoundError as exc:
        disabled = [r for r in registry.manager.records.values() if r.status == "disabled"]
        if not disabled:
            raise
        where = "this run's runtime" if from_runtime else "this registry"
        names = ", ".join(f"{r.name!r} ({r.value})" for r in disabled)
        raise ComponentNotFoundError(
            f"op builder {name!r} is not available in {where}: plugin(s) {names} are disabled "
            "(plugins.disable in ds_config or DSCORE_DISABLE_PLUGINS) and may be the provider. Remove it from "
            f"the disable list to use {name!r}. {exc}",
            kind=exc.kind,
            name=exc.name,
            available=exc.available,
            suggestions=exc.suggestions,
        ) from exc
    try:
        cls = resolve(spec.builder)
    except (ImportError, AttributeError, ValueError) as exc:
        raise OpBuildError(f"op builder {spec.name!r} ({spec.builder}) cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, OpBuilder)):
        raise OpBuildError(f"op builder {spec.name!r}: {spec.builder} is not an OpBuilder subclass")
    return cls


def get_op_builder(name: str, registry: Registry | None = None) -> OpBuilder:
    """Return a new instance of the op builder registered as ``name``; never ``None``.

    Looked up in ``registry``, else the current runtime's registry, else (outside ``initialize``) the
    installed plugins — see :func:`op_builder_class`.

    Raises:
        ComponentNotFoundError / PluginLoadError: no such op builder is active (names disabled plugins).
        OpBuildError: the registration does not resolve to an ``OpBuilder`` subclass.
    """
    return op_builder_class(name, registry)()
