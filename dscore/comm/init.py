"""``dscore.init_distributed``: create (or adopt) the default process group, DeepSpeed-compatible.

Mirrors ``deepspeed.init_distributed`` (``deepspeed/comm/comm.py``): same parameters and defaults, an
existing default group is reused, ``dist_init_required=False`` without a group is an error, the backend
defaults to the accelerator's. Additions: environment discovery with disagreement checks
(:mod:`dscore.comm.env`), the backend is a comm-backend plugin checked against the accelerator's device
type, a plugin-set check across ranks right after the group exists (:mod:`dscore.comm.fingerprint`),
and the call returns the :class:`~dscore.comm.facade.Comm` facade (DeepSpeed returns ``None``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from dscore.comm.env import DistributedEnv, discover_env
from dscore.comm.facade import Comm
from dscore.comm.fingerprint import verify_plugin_set
from dscore.errors import DistributedError
from dscore.specs import CommBackendSpec

if TYPE_CHECKING:
    from dscore.accelerator import Accelerator
    from dscore.plugin_manager import DscorePluginManager
    from dscore.registry import Registry

__all__ = ["default_timeout", "init_distributed", "resolve_comm_backend"]

log = logging.getLogger("dscore.comm")

DEFAULT_TIMEOUT_MINUTES = 10


def default_timeout(environ: Mapping[str, str] | None = None) -> timedelta:
    """``DSCORE_TIMEOUT`` or ``DEEPSPEED_TIMEOUT`` minutes (DeepSpeed's variable), default 10 minutes.

    Raises:
        DistributedError: the variable is not a positive number.
    """
    env = os.environ if environ is None else environ
    for name in ("DSCORE_TIMEOUT", "DEEPSPEED_TIMEOUT"):
        value = env.get(name, "").strip()
        if value:
            try:
                minutes = float(value)
            except ValueError:
                minutes = -1.0
            if minutes <= 0:
                raise DistributedError(f"{name}={value!r} must be a positive number of minutes")
            return timedelta(minutes=minutes)
    return timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)


def _as_timedelta(timeout: timedelta | float | None, environ: Mapping[str, str] | None) -> timedelta:
    if timeout is None:
        return default_timeout(environ)
    if isinstance(timeout, timedelta):
        return timeout
    if float(timeout) <= 0:
        raise DistributedError(f"timeout must be positive (seconds or a timedelta), got {timeout!r}")
    return timedelta(seconds=float(timeout))


def resolve_comm_backend(registry: Registry, name: str, accelerator: Accelerator) -> CommBackendSpec:
    """Look up comm backend ``name`` and check it can serve ``accelerator`` here.

    Raises:
        ComponentNotFoundError: no plugin provides ``name`` (lists what is installed).
        DistributedError: the backend does not serve the accelerator's device type (suggesting one that
            does, e.g. gloo for cpu), a required module is missing, or torch was built without it.
    """
    spec = registry.get_typed(CommBackendSpec, name, config_path="dist_backend")
    device_type = accelerator.device_type
    if device_type not in spec.device_types:
        fits = [
            s.name for s in registry.specs("comm_backend")
            if isinstance(s, CommBackendSpec) and device_type in s.device_types
        ]
        raise DistributedError(
            f"comm backend {spec.name!r} moves {'/'.join(spec.device_types)} tensors, but the accelerator is "
            f"{accelerator.name!r} (device type {device_type!r}). Use "
            + (" or ".join(f"dist_backend={f!r}" for f in fits) if fits else "a backend serving that device type")
            + " instead."
        )
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise DistributedError(
                f"comm backend {spec.name!r} needs the module {module!r}, which cannot be imported ({exc}); "
                "install it or choose another dist_backend"
            ) from exc
    accelerator.comm_backend_setup(spec.name)
    is_available = getattr(dist, "is_backend_available", None)
    if is_available is not None and not is_available(spec.torch_backend):
        raise DistributedError(
            f"comm backend {spec.name!r}: this torch build has no {spec.torch_backend!r} backend for "
            "torch.distributed (see torch.distributed.is_backend_available)"
        )
    return spec


def _backend_matches(requested: str, existing: str) -> bool:
    # torch reports "gloo", "nccl", or a device map like "cpu:gloo,cuda:nccl"
    parts = {p.split(":")[-1].strip().lower() for p in existing.split(",")}
    return requested.lower() in parts


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    rank: int = -1,
    world_size: int = -1,
    *,
    plugin_manager: DscorePluginManager | None = None,
    registry: Registry | None = None,
    accelerator: Accelerator | None = None,
    environ: Mapping[str, str] | None = None,
    verify_plugins: bool = True,
) -> Comm:
    """Make sure the default ``torch.distributed`` process group exists and return the facade over it.

    Idempotent: an existing default group (created by the user or an earlier call) is reused. Collective:
    with ``verify_plugins`` every rank must call it (ranks then compare their plugin sets).

    Args:
        dist_backend: a comm-backend plugin name (``"gloo"``, ``"nccl"``, ``"ccl"``, ``"hccl"``, ``"mpi"``);
            default: the accelerator's ``communication_backend_name()`` (gloo on CPU).
        auto_mpi_discovery: read MPI/AzureML/SageMaker variables (and mpi4py when installed).
        distributed_port: rendezvous port for MPI/SLURM jobs that do not set ``MASTER_PORT``.
        verbose: log the rendezvous at INFO.
        timeout: collective timeout (``timedelta`` or seconds); default ``DSCORE_TIMEOUT``/``DEEPSPEED_TIMEOUT``
            minutes, else 10 minutes.
        init_method: a torch init-method URL; default ``tcp://MASTER_ADDR:MASTER_PORT`` from discovery.
        dist_init_required: ``None``: create a group only if none exists; ``False``: a group must already exist.
        rank, world_size: explicit values (-1: discover); they must agree with the environment.
        plugin_manager, registry, accelerator: the runtime's (``dscore.runtime.Runtime.create`` passes them);
            created/selected here when omitted.
        environ: environment to discover from (default ``os.environ``). When it is ``os.environ``, the
            discovered ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` are exported
            for code that reads them later, as DeepSpeed does.
        verify_plugins: compare plugin fingerprints across ranks after the group exists.

    Returns:
        The :class:`~dscore.comm.facade.Comm` bound to the default group.

    Raises:
        DistributedError: ``dist_init_required=False`` with no group; an existing group uses another backend;
            the backend does not fit the accelerator (nccl on CPU suggests gloo); contradictory environment;
            ranks run different plugin sets.
        ComponentNotFoundError: ``dist_backend`` names no installed comm backend.
    """
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed support")
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    manager = plugin_manager or create_plugin_manager()
    reg = registry or Registry(manager)
    if accelerator is None:
        from dscore.accelerator import select_accelerator

        accelerator, _reason = select_accelerator(reg, environ=environ)

    created = False
    if dist.is_initialized():
        existing = str(dist.get_backend())
        backend_name = existing
        if dist_backend:
            spec = reg.get_typed(CommBackendSpec, dist_backend, config_path="dist_backend")
            if not _backend_matches(spec.torch_backend, existing):
                raise DistributedError(
                    f"a default process group already exists with backend {existing!r}, but dist_backend="
                    f"{dist_backend!r} was asked for. Pass dist_backend={existing!r} (or None to reuse it), or call "
                    "torch.distributed.destroy_process_group() first."
                )
            backend_name = spec.name
        env = _env_of_existing_group(environ)
        if verbose:
            log.info("reusing the existing process group (backend %s, rank %d of %d)", existing, env.rank, env.world_size)
    else:
        if dist_init_required is False:
            raise DistributedError(
                "the distributed backend is not initialized and dist_init_required=False; set "
                "dist_init_required=True (or None), or create the process group before calling dscore"
            )
        name = dist_backend or accelerator.communication_backend_name()
        spec = resolve_comm_backend(reg, name, accelerator)
        backend_name = spec.name
        env = discover_env(
            rank=rank, world_size=world_size, distributed_port=distributed_port,
            auto_mpi_discovery=auto_mpi_discovery, environ=environ,
        )
        if accelerator.device_type != "cpu":
            count = accelerator.device_count()
            if count > 0:
                accelerator.set_device(env.local_rank % count)
        method = init_method or env.init_method()
        if verbose:
            log.info(
                "initializing torch.distributed: backend=%s rank=%d world_size=%d local_rank=%d init_method=%s "
                "(from %s)", spec.torch_backend, env.rank, env.world_size, env.local_rank, method, env.source,
            )
        if environ is None or environ is os.environ:
            for key, value in (
                ("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port),
            ):
                os.environ.setdefault(key, str(value))
        dist.init_process_group(
            backend=spec.torch_backend, init_method=method, rank=env.rank, world_size=env.world_size,
            timeout=_as_timedelta(timeout, environ),
        )
        created = True
        manager.call("dscore_distributed_initialized", rank=env.rank, world_size=env.world_size, backend=spec.name)

    comm = Comm(None, backend=backend_name, env=env)
    if verify_plugins and comm.get_world_size() > 1:
        try:
            verify_plugin_set(manager, comm)
        except DistributedError:
            if created:
                dist.destroy_process_group()
            raise
    return comm


def _env_of_existing_group(environ: Mapping[str, str] | None) -> DistributedEnv:
    env = os.environ if environ is None else environ
    rank, world = int(dist.get_rank()), int(dist.get_world_size())
    local_rank_text = env.get("LOCAL_RANK", "").strip()
    local_world_text = env.get("LOCAL_WORLD_SIZE", "").strip()
    local_rank = int(local_rank_text) if local_rank_text.isdigit() else (0 if world == 1 else rank)
    local_world = int(local_world_text) if local_world_text.isdigit() else world
    port_text = env.get("MASTER_PORT", "").strip()
    return DistributedEnv(
        rank, world, local_rank, local_world, env.get("MASTER_ADDR", ""), int(port_text) if port_text.isdigit() else 0,
        "existing-process-group",
    )
