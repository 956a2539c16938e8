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


def op_builder_class(name: str, registry: Registry | None = None) -> type[OpBuilder]:
    """Return the :class:`OpBuilder` subclass registered under ``name`` (case-insensitive, aliases too).

    Args:
        name: op name (``"cpu_adam"``).
        registry: the registry to search; default: one over the installed plugins.

    Raises:
        ComponentNotFoundError / PluginLoadError: no active plugin registers ``name`` (lists what exists).
        OpBuildError: the registered import string does not resolve to an ``OpBuilder`` subclass.
    """
    from dscore.specs import OpBuilderSpec, resolve

    if registry is None:
        from dscore.plugin_manager import create_plugin_manager
        from dscore.registry import Registry

        registry = Registry(create_plugin_manager())
    spec = registry.get_typed(OpBuilderSpec, name)
    try:
        cls = resolve(spec.builder)
    except (ImportError, AttributeError, ValueError) as exc:
        raise OpBuildError(f"op builder {spec.name!r} ({spec.builder}) cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, OpBuilder)):
        raise OpBuildError(f"op builder {spec.name!r}: {spec.builder} is not an OpBuilder subclass")
    return cls


def get_op_builder(name: str, registry: Registry | None = None) -> OpBuilder:
    """Return a new instance of the op builder registered as ``name``; never ``None``.

    Raises:
        ComponentNotFoundError / PluginLoadError: no such op builder is installed.
        OpBuildError: the registration does not resolve to an ``OpBuilder`` subclass.
    """
    return op_builder_class(name, registry)()
