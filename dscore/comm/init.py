"""``dscore.init_distributed``: create (or adopt) the default process group, DeepSpeed-compatible.

Mirrors ``deepspeed.init_distributed`` (``deepspeed/comm/comm.py``): same parameters and defaults, an
existing default group is reused, ``dist_init_required=False`` without a group is an error, the backend
defaults to the accelerator's. Additions: environment discovery with disagreement checks
(:mod:`dscore.comm.env`), the backend is a comm-backend plugin checked against the accelerator's device
type, a plugin-set check across ranks right after the group exists (:mod:`dscore.comm.fingerprint`),
and the call returns the :class:`~dscore.comm.facade.Comm` facade (DeepSpeed returns ``None``).

Who ends the process group (DeepSpeed never does; dscore does, for the group it made):

* A default group that dscore created (here, from :func:`dscore.initialize` or an explicit
  :func:`dscore.init_distributed`) is *owned* by dscore: :data:`PROCESS_GROUP_OWNER` destroys it before the
  interpreter starts finalizing, from an ``atexit`` hook — so whatever way the script ends (normal end,
  ``sys.exit``, an exception after training, Ctrl-C) it is torn down while Python is still fully alive.
* It is also destroyed when the last open engine built on a group created by ``dscore.initialize`` is
  closed (:meth:`dscore.runtime.engine.DscoreEngine.close`). A group created by an explicit
  ``dscore.init_distributed()`` lives until exit (or until the user destroys it).
* A group the user created (``torch.distributed.init_process_group`` before dscore) stays the user's:
  dscore never destroys it, at exit or ever.

Why a destroyed group must really be *freed*: a gloo group's worker threads hold the last reference to each
collective's tensors for a moment after the collective completed (and for the whole life of one nobody
waited on). Dropping a tensor that Python created needs the GIL; a thread that takes the GIL while the
interpreter finalizes is ended with ``pthread_exit``, and that unwinding through a ``noexcept`` C++
destructor (``~AsyncWork`` in ``ProcessGroupGloo::runLoop``) calls ``std::terminate``: ``terminate called
without an active exception``, SIGABRT, exit 134, on a rank whose worker happened to lag (a loaded machine).
``destroy_process_group`` only unregisters the group; its backend, and so its worker threads, end when the
last reference to the group object goes, and then the backend joins its workers with the GIL released,
deterministically. But torch modules imported while the default group exists capture it *as a default
argument* (``torch.distributed.nn.functional``'s ``group=group.WORLD``, also ``ZeroRedundancyOptimizer``'s
and ``ShardedGradScaler``'s helpers), and ``torch.optim.Adam`` imports ``torch._dynamo``, which imports
them: after ``dscore.initialize`` (the group exists before the optimizer is built), such references (ten with torch 2.13, all
from ``torch.distributed.nn.functional``) keep the group — and its threads — alive past any
``destroy_process_group`` into interpreter finalization. :func:`release_torch_group_pins` rebinds those
defaults to ``None`` (torch's own value for "the default group, looked up at call time", which they hold
when imported before any group exists); dscore calls it when an engine takes the group, at exit (its hook
runs before any hook registered earlier, the usual place for a user's ``destroy_process_group``) and before
destroying its own group, so that the user's destroy, or dscore's, joins the worker threads while Python is
alive.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dscore import process
from dscore.comm.env import DistributedEnv, discover_env, existing_group_env
from dscore.comm.exit_drain import backend_workers_present, drain_backend_workers
from dscore.comm.facade import Comm
from dscore.comm.fingerprint import verify_plugin_set
from dscore.comm.guard import ensure_all_arrived
from dscore.comm.transports import flush_pending_sends
from dscore.errors import DistributedError
from dscore.specs import CommBackendSpec

if TYPE_CHECKING:
    from dscore.accelerator import Accelerator
    from dscore.plugin_manager import DscorePluginManager
    from dscore.registry import Registry

__all__ = [
    "PROCESS_GROUP_OWNER",
    "ProcessGroupOwner",
    "default_timeout",
    "init_distributed",
    "release_torch_group_pins",
    "resolve_comm_backend",
]

log = logging.getLogger("dscore.comm")

DEFAULT_TIMEOUT_MINUTES = 10


class ProcessGroupOwner:
    """Remembers whether dscore created the current default process group, and ends it when due.

    One instance per process (:data:`PROCESS_GROUP_OWNER`): torch.distributed's default group is itself
    process-wide. The rule it enforces is in the module docstring: dscore destroys only a group it
    created, at interpreter exit (``atexit``) and when the last open engine on a group created by
    ``dscore.initialize`` is closed; a group created by the user is never touched. For every group, its
    own or the user's, it removes the references torch modules captured at import
    (:func:`release_torch_group_pins`) so that destroying the group ends its worker threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._group: weakref.ReferenceType[Any] | None = None
        self._created_by_engine = False
        self._leases = 0
        self._atexit_registered = False

    def _register_exit_hook(self) -> None:
        # called with self._lock held; atexit runs hooks last-in first-out, so this one runs before any
        # hook registered earlier (a user's destroy_process_group, typically)
        if not self._atexit_registered:
            process.apply("group_exit_hook", atexit.register, self.destroy_at_exit)
            self._atexit_registered = True

    def note_created(self) -> None:
        """Record that dscore just created the default group (called by :func:`init_distributed`)."""
        with self._lock:
            self._group = weakref.ref(dist.group.WORLD)
            self._created_by_engine = False
            self._leases = 0
            self._register_exit_hook()

    def note_adopted(self) -> None:
        """Record that dscore uses a default group it did not create (called by :func:`init_distributed`).

        Only the exit hook is registered (it releases torch's import-time references, see
        :func:`release_torch_group_pins`); the group stays the user's.
        """
        with self._lock:
            self._register_exit_hook()

    def owns_default_group(self) -> bool:
        """True when a default group exists and it is the one dscore created."""
        if self._group is None or not (dist.is_available() and dist.is_initialized()):
            return False
        return self._group() is dist.group.WORLD

    def acquire(self, comm: Comm) -> None:
        """An engine starts using the default group through ``comm`` (one lease per engine).

        Engines are built after their optimizer, whose construction imports ``torch._dynamo`` and with
        it the torch modules that capture the default group (:func:`release_torch_group_pins`): their
        references are released here, whoever created the group.
        """
        with self._lock:
            self._leases += 1
            if comm.owns_group and self.owns_default_group():
                self._created_by_engine = True
            self._register_exit_hook()
        process.apply("torch_group_pins", release_torch_group_pins)

    def release(self) -> bool:
        """An engine is done with the group; destroy it when it was the last one and an engine's
        ``initialize`` created it. Returns True when the group was destroyed."""
        with self._lock:
            self._leases = max(0, self._leases - 1)
            due = self._leases == 0 and self._created_by_engine
        return self.destroy("the last engine using it was closed") if due else False

    def destroy(self, why: str) -> bool:
        """Destroy the default group if dscore created it (else leave it alone). Returns True if destroyed.

        torch's import-time references to the group are released first, so that when nothing else
        references it, ``destroy_process_group`` frees it: its backend then finishes the queued
        collectives and joins its worker threads here, with the GIL released, while Python is alive.
        """
        with self._lock:
            if not self.owns_default_group():
                return False
            self._group = None
            self._created_by_engine = False
            self._leases = 0
        log.debug("destroying the process group dscore created (%s)", why)
        process.apply("torch_group_pins", release_torch_group_pins)
        flush_pending_sends()
        dist.destroy_process_group()
        if backend_workers_present():
            # some group survived its destroy: the default one kept by code dscore does not control, or a
            # sub-group a live engine still holds (the pipeline engine's stage groups). Its backend and
            # worker threads then live into finalization: let them finish and drop what they ran while the
            # interpreter is alive (dscore.comm.exit_drain)
            log.debug("a destroyed process group is still referenced; waiting for its worker threads to park")
            process.apply("exit_drain", drain_backend_workers)
        return True

    def destroy_at_exit(self) -> None:
        """The ``atexit`` hook: tear the owned group down while the interpreter is still fully alive.

        For a group the user created it only releases torch's import-time references to it (modules
        imported after the engine was built), so that the user's own ``destroy_process_group`` — in a
        hook registered before dscore's, or at the end of the script — ends its threads; the group itself
        is left alone.
        """
        try:
            if not self.destroy("the interpreter is exiting"):
                # the user's group: deliver and drop dscore's own work on it, then let gloo's workers finish
                # and drop the collectives in flight while the interpreter is alive (a worker that drops one
                # during finalization needs the GIL and aborts the process: dscore.comm.exit_drain)
                flush_pending_sends()
                process.apply("torch_group_pins", release_torch_group_pins)
                process.apply("exit_drain", drain_backend_workers)
        except Exception as exc:  # noqa: BLE001 - exit must go on; say what happened
            log.warning("could not end the process group cleanly at exit: %s", exc)


# the torch packages whose modules capture ``group.WORLD`` in default arguments at import time
_PINNING_PACKAGE = "torch.distributed"


def release_torch_group_pins(group: Any = None) -> int:
    """Rebind default arguments of ``torch.distributed`` functions that hold ``group`` to ``None``.

    Some torch modules write ``def f(..., group=group.WORLD)``: the default is evaluated when the module
    is imported, so a module imported while a default group exists holds that group object for the
    life of the process (``torch.distributed.nn.functional``: ten functions;
    ``torch.distributed.optim.zero_redundancy_optimizer``; ``ShardedGradScaler.__init__``). Then
    ``destroy_process_group`` cannot free the group, and the group's worker threads outlive it into
    interpreter finalization (the abort explained in the module docstring). ``None`` is the value these
    defaults hold when the module is imported before any group exists, and every torch.distributed call
    reads it as "the default group", looked up at call time: the functions behave the same while the
    group exists, and correctly after it was replaced.

    Only loaded modules under ``torch.distributed`` are scanned (module-level functions and the methods
    of classes defined there; about 3 ms with ``torch._dynamo`` loaded); objects are compared by identity.

    Args:
        group: the process group object to release (default: the current default group; nothing to do
            without one).

    Returns:
        The number of default values rebound.
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        group = dist.group.WORLD
        if group is None:
            return 0
    released = 0
    prefix = _PINNING_PACKAGE + "."
    for name, module in list(sys.modules.items()):
        if module is None or not (name == _PINNING_PACKAGE or name.startswith(prefix)):
            continue
        try:
            members = list(vars(module).values())
        except TypeError:
            continue
        for value in members:
            # exact type checks: attribute access on some module members warns (deprecated aliases)
            if type(value) is types.FunctionType:
                released += _release_defaults(value, group)
            elif issubclass(type(value), type) and getattr(value, "__module__", None) == name:
                for attr in list(vars(value).values()):
                    func = attr.__func__ if type(attr) in (staticmethod, classmethod) else attr
                    if type(func) is types.FunctionType:
                        released += _release_defaults(func, group)
    if released:
        log.debug("released %d import-time reference(s) of torch.distributed to the process group", released)
    return released


def _release_defaults(func: types.FunctionType, group: Any) -> int:
    count = 0
    defaults = func.__defaults__
    if defaults and any(d is group for d in defaults):
        count += sum(1 for d in defaults if d is group)
        func.__defaults__ = tuple(None if d is group else d for d in defaults)
    kwdefaults = func.__kwdefaults__
    if kwdefaults and any(v is group for v in kwdefaults.values()):
        count += sum(1 for v in kwdefaults.values() if v is group)
        func.__kwdefaults__ = {k: (None if v is group else v) for k, v in kwdefaults.items()}
    return count


#: the process-wide owner of the default process group dscore created (see :class:`ProcessGroupOwner`).
PROCESS_GROUP_OWNER = ProcessGroupOwner()
Comm.group_owner = PROCESS_GROUP_OWNER  # Comm.destroy() ends the group through it


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
    with ``verify_plugins`` every rank must call it (ranks then compare their plugin sets), and a rank
    that does not arrive within the arrival timeout (:mod:`dscore.comm.guard`) makes the others raise.
    A group created here is dscore's: it is destroyed at interpreter exit (see the module docstring);
    an existing group is never destroyed by dscore.

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
        ConfigError: ``DSCORE_PROCESS_POLICIES`` names an unknown policy (:mod:`dscore.process`).
    """
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed support")
    process.selected_policies()  # a malformed DSCORE_PROCESS_POLICIES is refused before any group exists
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
        PROCESS_GROUP_OWNER.note_adopted()
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
                process.apply("rendezvous_env", os.environ.setdefault, key, str(value))
        dist.init_process_group(
            backend=spec.torch_backend, init_method=method, rank=env.rank, world_size=env.world_size,
            timeout=_as_timedelta(timeout, environ),
        )
        created = True
        PROCESS_GROUP_OWNER.note_created()
        manager.call("dscore_distributed_initialized", rank=env.rank, world_size=env.world_size, backend=spec.name)

    comm = Comm(None, backend=backend_name, env=env, owns_group=created, registry=reg)
    comm.accelerator = accelerator  # object collectives on a device backend use its current device
    if verify_plugins and comm.get_world_size() > 1:
        try:
            ensure_all_arrived("initialize")
        except DistributedError:
            if created:
                PROCESS_GROUP_OWNER.destroy("not every rank called initialize")
            raise
        try:
            verify_plugin_set(manager, comm)
        except DistributedError:
            if created:
                PROCESS_GROUP_OWNER.destroy("the ranks run different plugin sets")
            raise
    return comm


def _env_of_existing_group(environ: Mapping[str, str] | None) -> DistributedEnv:
    # local rank from LOCAL_RANK, else the MPI/SLURM variables (dscore.comm.env.existing_group_env);
    # LOCAL_RANK is exported for user code, as for a group dscore creates
    env = existing_group_env(int(dist.get_rank()), int(dist.get_world_size()), environ=environ)
    if environ is None or environ is os.environ:
        process.apply("rendezvous_env", os.environ.setdefault, "LOCAL_RANK", str(env.local_rank))
    return env
