"""The transports :class:`dscore.comm.Comm` runs a collective on, and how one is chosen for a call.

* :mod:`~dscore.comm.transports.native` (core) — the backend's own collectives (``torch.distributed``:
  NCCL, gloo, any registered backend) with exact emulations of what a backend lacks. Each
  :class:`~dscore.comm.Comm` holds one (:attr:`Comm.native`); it is always the fallback and the only one
  a non-CPU tensor ever takes.
* the registered transports (``comm_transport`` units, :class:`~dscore.specs.CommTransportSpec`): the comm
  plugin's ``shm`` (same-host shared memory) and ``p2p`` (gloo point-to-point), or a third party's. A
  facade builds them from its registry (:func:`registered_transports`) and asks them per call in
  descending priority (:func:`pick`). ``plugins.disable: ["comm_transport:shm"]`` leaves one out.

The contract a transport implements is :class:`dscore.protocols.transport.Transport` (re-exported here);
its factory receives a :class:`~dscore.protocols.transport.TransportContext`. :func:`flush_pending_sends`
reaches every transport built in this process through that contract. This package imports no torch.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dscore.protocols.transport import TRANSPORT_OPS, Transport, TransportContext

if TYPE_CHECKING:  # pragma: no cover
    from dscore.registry import Registry
    from dscore.specs import CommTransportSpec

__all__ = [
    "TRANSPORT_OPS",
    "Transport",
    "TransportContext",
    "current_registry",
    "default_registry",
    "flush_pending_sends",
    "pick",
    "registered_transports",
    "set_registry_source",
    "transport_specs",
]

log = logging.getLogger("dscore.comm")

# where a facade built without a registry finds the current one (dscore.runtime.context sets it: the
# runtime layer sits above comm, so comm is told rather than importing it)
_registry_source: Callable[[], Registry | None] | None = None
# the fallback outside any runtime, per value of the variables that decide the plugin set
_default: dict[tuple[str, ...], Registry] = {}
# ordered transport specs per registry (gated by their op builders), computed once per registry
_ordered: weakref.WeakKeyDictionary[Registry, tuple[CommTransportSpec, ...]] = weakref.WeakKeyDictionary()
# one built transport per spec name: its flush() is process-wide (the contract)
_flushers: dict[str, Transport] = {}
_lock = threading.Lock()
_ENV_KEYS = ("DSCORE_DISABLE_PLUGINS", "DSCORE_PLUGINS", "DSCORE_DISABLE_PLUGIN_AUTOLOAD")


def set_registry_source(source: Callable[[], Registry | None] | None) -> None:
    """Tell the facades where the current registry is (``source() -> Registry | None``; None: none is
    current). :mod:`dscore.runtime.context` installs the current runtime's."""
    global _registry_source
    _registry_source = source


def current_registry() -> Registry | None:
    """The current runtime's registry (through :func:`set_registry_source`), or None outside a runtime."""
    return _registry_source() if _registry_source is not None else None


def default_registry() -> Registry:
    """The registry a facade built without one uses: the current runtime's (``plugins.disable`` holds),
    else one over the installed plugins (``DSCORE_DISABLE_PLUGINS`` holds), cached per value of the
    plugin-selection variables."""
    current = current_registry()
    if current is not None:
        return current
    key = tuple(os.environ.get(k, "") for k in _ENV_KEYS)
    with _lock:
        registry = _default.get(key)
        if registry is None:
            from dscore.plugin_manager import create_plugin_manager
            from dscore.registry import Registry

            registry = _default[key] = Registry(create_plugin_manager())
    return registry


def transport_specs(registry: Registry) -> tuple[CommTransportSpec, ...]:
    """The registry's transports in the order a facade asks them: descending ``priority``, ties by name.

    A transport whose op builder (``op_builders``) is disabled or not registered is left out (logged once):
    disabling ``op_builder:shm_sync`` turns the shm transport off, never the core."""
    with _lock:
        cached = _ordered.get(registry)
        if cached is not None:
            return cached
    from dscore.errors import DscoreError
    from dscore.specs import CommTransportSpec

    kept: list[CommTransportSpec] = []
    for spec in registry.specs("comm_transport"):
        assert isinstance(spec, CommTransportSpec)
        try:
            for op in spec.op_builders:
                registry.get("op_builder", op, config_path=f"comm_transport:{spec.name}.op_builders")
        except DscoreError as exc:
            log.info("comm transport %r is off: its op builder is not available (%s)", spec.name, exc)
            continue
        kept.append(spec)
    ordered = tuple(sorted(kept, key=lambda s: (-s.priority, s.name.lower())))
    with _lock:
        _ordered[registry] = ordered
    return ordered


def registered_transports(
    registry: Registry, *, backend: str, pairwise: Callable[[Any], bool], native: Transport
) -> tuple[Transport, ...]:
    """Build the registry's transports for one facade, in asking order (:func:`transport_specs`).

    Args:
        registry: where the ``comm_transport`` units come from.
        backend, pairwise, native: the facade's, handed to each factory (:class:`TransportContext`).

    Raises:
        PluginLoadError: a factory's import string does not resolve (names the plugin).
        PluginValidationError: a factory returned something without the :class:`Transport` operations.
    """
    from dscore.errors import PluginValidationError

    specs = transport_specs(registry)
    built: list[Transport] = []

    def delegate_from(index: int) -> Callable[[str, Any, Sequence[Any]], Transport]:
        def delegate(op: str, group: Any, tensors: Sequence[Any]) -> Transport:
            return pick(group, True, tensors, op=op, transports=built[index + 1 :]) or native

        return delegate

    for i, spec in enumerate(specs):
        factory = registry.load(spec, "factory")
        ctx = TransportContext(
            spec=spec, registry=registry, backend=backend, pairwise=pairwise, native=native,
            delegate=delegate_from(i),
        )  # fmt: skip
        transport = factory(ctx)
        if not isinstance(transport, Transport):
            record = registry.provider(spec)
            raise PluginValidationError(
                f"plugin {record.label()}: comm transport {spec.name!r} ({spec.factory}) returned {transport!r}, "
                "which lacks the Transport operations (accepts, all_reduce, reduce_scatter, all_gather, flush)"
            )
        built.append(transport)
        with _lock:
            _flushers.setdefault(spec.name, transport)
    return tuple(built)


def pick(grp: Any, eligible: bool, tensors: Sequence[Any], *, op: str = "all_gather",
         transports: Sequence[Transport] = ()) -> Transport | None:
    """The registered transport that runs one call of ``op`` on ``grp``, or None for the native one.

    ``eligible``: the call may leave the backend at all (the facade's test: a sum or average over
    contiguous, non-bool tensors for the reductions, contiguous tensors for a gather). A non-CPU tensor
    always takes the native path (NCCL's rule: host shared memory or gloo point-to-point never stands in
    for device memory; issue 28, defect 4). Otherwise the first of ``transports`` (in asking order) whose
    ``accepts(op, grp, tensors)`` says yes.

    Raises:
        ValueError: ``op`` is not one of :data:`TRANSPORT_OPS`.
    """
    if op not in TRANSPORT_OPS:
        raise ValueError(f"unknown transport operation {op!r}; known: {sorted(TRANSPORT_OPS)}")
    if not eligible or any(t.device.type != "cpu" for t in tensors):
        return None
    for transport in transports:
        if transport.accepts(op, grp, tensors):
            return transport
    return None


def flush_pending_sends(timeout: float = 60.0) -> int:
    """Deliver what peers may still wait for, on every transport built in this process (``timeout``
    seconds for each; :meth:`Transport.flush`): the shared-memory channels' gloo sends, the gloo
    point-to-point transfers of works dropped unwaited, a third party's own. Run before a process group
    is destroyed and at exit. Returns the transfers left undelivered."""
    with _lock:
        transports = list(_flushers.items())
    return sum(int(transport.flush(timeout)) for _, transport in transports)
