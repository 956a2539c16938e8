"""The :class:`Runtime`: everything one ``dscore.initialize`` needs besides the config and the model.

A runtime bundles the plugin manager, its registry, the selected accelerator (and why it was chosen), the
collective facade over the default process group, and where this process sits in the job. It replaces
DeepSpeed's module-level singletons (``get_accelerator()``, ``deepspeed.comm.cdb``): the engine keeps
one, and deep code reads it through :func:`dscore.runtime.context.current_runtime`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dscore.accelerator import Accelerator
    from dscore.comm.env import DistributedEnv
    from dscore.comm.facade import Comm
    from dscore.config.model import DscoreConfig
    from dscore.parallel.mesh import ParallelMesh
    from dscore.plugin_manager import DscorePluginManager
    from dscore.registry import Registry

__all__ = ["Runtime"]

log = logging.getLogger("dscore.runtime")


@dataclass
class Runtime:
    """Plugin manager, registry, accelerator and comm facade of one ``initialize``.

    Attributes:
        plugin_manager: the plugin manager (its records decide the plugin fingerprint).
        registry: typed lookups over the active plugins' specs.
        accelerator: the selected :class:`~dscore.accelerator.Accelerator`.
        accelerator_reason: one line saying why it was selected.
        comm: the collective facade bound to the default process group.
        env: rank, world size, local rank and rendezvous of this process.
    """

    plugin_manager: DscorePluginManager
    registry: Registry
    accelerator: Accelerator
    accelerator_reason: str
    comm: Comm
    env: DistributedEnv
    mesh: ParallelMesh | None = None
    """The parallel mesh (data x sequence x tensor) ``dscore.initialize`` built; None before."""

    @classmethod
    def create(
        cls,
        *,
        config: DscoreConfig | None = None,
        accelerator: str | None = None,
        disable_plugins: Sequence[str] = (),
        dist_backend: str | None = None,
        distributed_port: int = 29500,
        dist_init_required: bool | None = None,
        timeout: timedelta | float | None = None,
        plugin_manager: DscorePluginManager | None = None,
        registry: Registry | None = None,
        extra_plugins: Iterable[tuple[str, object]] = (),
        environ: Mapping[str, str] | None = None,
    ) -> Runtime:
        """Discover plugins, select the accelerator, initialise (or adopt) the process group.

        Args:
            config: the validated ``DscoreConfig``; its ``accelerator`` and ``plugins.disable`` are used when
                the arguments below are not given.
            accelerator: an accelerator name (``None``: the config's, then ``DS_ACCELERATOR``, then probes).
            disable_plugins: plugin names to disable (added to the config's ``plugins.disable``).
            dist_backend, distributed_port, dist_init_required, timeout: passed to
                :func:`dscore.comm.init.init_distributed`.
            plugin_manager: use this manager instead of discovering (then ``disable_plugins``, the config's
                ``plugins.disable`` and ``extra_plugins`` are ignored: the caller applied them).
            registry: the registry of ``plugin_manager`` when the caller already built one.
            extra_plugins: ``(name, plugin)`` pairs registered after discovery (tests, embedding).
            environ: environment for ``DS_ACCELERATOR`` and rank discovery (default ``os.environ``).

        Returns:
            A new runtime; it is not made current (use :func:`dscore.runtime.context.use_runtime` or
            ``set_runtime``).

        Raises:
            PluginValidationError: a plugin implements a misspelled hook.
            AcceleratorError: the requested accelerator is not installed or not usable.
            DistributedError: see :func:`dscore.comm.init.init_distributed` (bad environment, backend that
                does not fit the accelerator, plugin sets that differ between ranks).
        """
        from dscore.accelerator import select_accelerator
        from dscore.comm.init import init_distributed
        from dscore.plugin_manager import create_plugin_manager
        from dscore.registry import Registry

        if accelerator is None and config is not None:
            accelerator = config.accelerator
        config_disable = list(config.plugins.disable) if config is not None else []
        manager = plugin_manager or (registry.manager if registry is not None else None)
        if manager is None:
            manager = create_plugin_manager(
                disable=[*config_disable, *disable_plugins],
                extra_plugins=extra_plugins,
                environ=dict(environ) if environ is not None else None,
            )
        manager.check_healthy()
        if registry is None or registry.manager is not manager:
            registry = Registry(manager)
        chosen, reason = select_accelerator(registry, accelerator, environ)
        comm = init_distributed(
            dist_backend=dist_backend,
            distributed_port=distributed_port,
            dist_init_required=dist_init_required,
            timeout=timeout,
            plugin_manager=manager,
            registry=registry,
            accelerator=chosen,
            environ=environ,
        )
        assert comm.env is not None
        return cls(manager, registry, chosen, reason, comm, comm.env)
