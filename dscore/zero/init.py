"""``dscore.zero.Init`` (partition parameters as modules are built) and ``GatheredParameters``.

Design choice (documented as the brief asks): this is self-contained core code. It does not look up
the stage-3 plugin; instead the stage-3 plugin imports :mod:`dscore.zero.partition` and recognises
parameters partitioned here by :func:`dscore.zero.partition.unit_of`. Both therefore share one storage
model (:class:`~dscore.zero.partition.FlatUnit`).

Mirrors DeepSpeed's ``deepspeed.zero.Init`` / ``deepspeed.zero.GatheredParameters``
(``deepspeed/runtime/zero/partition_parameters.py``): inside ``Init`` every ``torch.nn.Module``
subclass's ``__init__`` is wrapped so that, when the outermost ``__init__`` of a module instance returns,
the module's own (non-recursive) parameters are broadcast from rank 0 (so every rank agrees on the
random initialisation), and only this rank's ``1/world`` chunk is kept. Peak memory while building is
therefore the partitions plus the largest single module, which lets a model larger than one rank's
memory be constructed.

Touching a partitioned parameter while building (a subclass ``__init__`` writing a weight its parent's
submodule made, ``self.lin.weight.fill_(0.25)``; a ``post_init`` re-initialising weights; DeepSpeed PR
#1202) gathers it for that one operation: inside the context a torch-function mode sees every torch call
whose arguments hold a released partitioned parameter, gathers its unit, runs the call, takes rank 0's
values (construction code runs on every rank) into every rank's partition and releases it again, so the
value lands. A call returning a view of the gathered storage keeps the unit gathered until the outermost
module under construction returns (or the context exits), so the view stays valid. Metadata reads
(``shape``, ``dtype``, ...) gather nothing.

Outside the context (after the build, and after ``dscore.initialize`` outside forward/backward) no gather
happens on touch: a torch call that would read or write a released parameter's values raises
``dscore.errors.PartitionedParameterError`` naming the parameter and ``GatheredParameters``
(:mod:`dscore.zero.released`; a gather is a collective, and code after the build may run on one rank only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dscore.comm import Comm
from dscore.zero.partition import FlatUnit, unit_of
from dscore.zero.released import _NAME_ATTR, name_parameters

__all__ = ["Init", "GatheredParameters"]

log = logging.getLogger("dscore.zero")

_DEPTH_ATTR = "_dscore_init_depth"


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    stack: list[type] = [cls]
    while stack:
        c = stack.pop()
        subclasses: list[type] = c.__subclasses__()
        for sub in subclasses:
            if sub not in out:
                out.add(sub)
                stack.append(sub)
    return out


def _config_dtype(source: Any) -> torch.dtype:
    """The partition dtype a ds_config asks for (DeepSpeed's ``zero.Init`` rule)."""
    from dscore.config.loader import read_source
    from dscore.errors import ConfigError

    data, name, _warnings = read_source(source)

    def enabled(key: str) -> bool:
        block = data.get(key)
        return isinstance(block, dict) and block.get("enabled") is True

    if enabled("bf16") and enabled("fp16"):
        raise ConfigError(f"{name}: bf16.enabled and fp16.enabled are both true", path="bf16.enabled", source=name)
    if enabled("bf16") or enabled("bfloat16"):
        return torch.bfloat16
    return torch.float16 if enabled("fp16") else torch.float32


class Init:
    """Context manager: modules constructed inside it are born partitioned across data-parallel ranks.

    Args:
        module: ignored unless given, in which case its existing parameters are partitioned on entry
            (DeepSpeed's ``Init(module=...)``).
        comm: the comm facade (its process group is used) or None for the default group.
        group: an explicit ``torch.distributed`` process group (overrides ``comm``).
        dtype: dtype the partitions are stored in (default: each module's parameter dtype; all
            parameters of one module must then share a dtype).
        device: device of the partitions (default: the parameters' device).
        enabled: False makes the context a no-op (DeepSpeed's ``enabled=``).
        config_dict_or_path: the ds_config (dict, path or base64). When ``dtype`` is None it sets the
            partitions' dtype as DeepSpeed does: ``bf16.enabled`` -> bfloat16, ``fp16.enabled`` -> float16,
            neither -> float32 (both enabled is a ``ConfigError``). Other ZeRO options are read by the engine.

    Raises:
        DistributedError: ``torch.distributed`` is not initialised and ``enabled`` (the message names the
            launcher's ``WORLD_SIZE``/``RANK`` and ``dscore.init_distributed()``).
        RuntimeError: a module mixes parameter dtypes without ``dtype``.

    Example::

        with dscore.zero.Init():
            model = BigModel()          # each rank holds 1/world of every parameter
        engine, *_ = dscore.initialize(model=model, config={"zero_optimization": {"stage": 3}, ...})
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        *,
        comm: Comm | None = None,
        group: Any = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        enabled: bool = True,
        config_dict_or_path: Any = None,
    ) -> None:
        self.enabled = enabled
        if dtype is None and config_dict_or_path is not None and enabled:
            dtype = _config_dtype(config_dict_or_path)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self._comm = comm
        self._group = group
        self._patched: list[tuple[type, Any]] = []
        self._orig_init_subclass: Any = None
        self.comm: Comm | None = None
        self._constructing = 0  # module constructors running inside the context
        self._held: list[FlatUnit] = []  # units gathered for a view that escaped one call
        self._mode: _GatherOnTouch | None = None
        if module is not None and enabled:
            self.comm = self._collectives()
            for m in module.modules():
                self._partition_module(m)
            name_parameters(module)

    def _collectives(self) -> Comm:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            import os

            from dscore.errors import DistributedError

            launched = os.environ.get("WORLD_SIZE")
            where = (
                f"this process was launched as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={launched}, but no "
                "process group exists yet"
                if launched
                else "no process group exists (WORLD_SIZE is not set: not started by a launcher)"
            )
            raise DistributedError(
                f"dscore.zero.Init needs torch.distributed to be initialised: {where}. Call "
                "dscore.init_distributed() (or torch.distributed.init_process_group) before entering it, or pass "
                "enabled=False"
            )
        base = self._comm if isinstance(self._comm, Comm) else Comm(None, backend=str(torch.distributed.get_backend()))
        if self._group is not None:
            return base.bound_to(self._group)
        return base

    # ------------------------------------------------------------------ patching
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self.comm = self._collectives()
        for cls in [torch.nn.Module, *_all_subclasses(torch.nn.Module)]:
            self._wrap(cls)
        ctx = self
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            ctx._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self._mode = _GatherOnTouch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._release_held()
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig  # type: ignore[misc]
        self._patched.clear()
        if self._orig_init_subclass is not None:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass  # type: ignore[assignment]
        else:
            try:
                del torch.nn.Module.__init_subclass__
            except AttributeError:
                pass

    def _wrap(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_dscore_wrapped", False):
            return
        ctx = self

        @functools.wraps(orig)
        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get(_DEPTH_ATTR, 0)
            object.__setattr__(module, _DEPTH_ATTR, depth + 1)
            ctx._constructing += 1
            try:
                orig(module, *args, **kwargs)
            finally:
                object.__setattr__(module, _DEPTH_ATTR, depth)
                ctx._constructing -= 1
            if depth == 0:
                ctx._partition_module(module)
            if ctx._constructing == 0:
                ctx._release_held()
                name_parameters(module)  # the outermost module built: qualified names for errors

        wrapped._dscore_wrapped = True  # type: ignore[attr-defined]
        cls.__init__ = wrapped  # type: ignore[misc]
        self._patched.append((cls, orig))

    # ------------------------------------------------------------------ touching partitioned parameters
    @torch.no_grad()
    def _publish(self, unit: FlatUnit) -> None:
        """Rank 0's (possibly modified) values into every rank's partition, then free ``full``."""
        assert self.comm is not None
        unit.comm.broadcast(unit.full, unit.comm.global_rank(0))
        unit.write_back()
        unit.release()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for u in held:
            if u.gathered:
                self._publish(u)

    # ------------------------------------------------------------------ partitioning
    @torch.no_grad()
    def _partition_module(self, module: torch.nn.Module) -> None:
        assert self.comm is not None
        params = [p for p in module.parameters(recurse=False) if unit_of(p) is None]
        if not params:
            return
        dtypes = {p.dtype for p in params}
        if self.dtype is None and len(dtypes) > 1:
            raise RuntimeError(
                f"dscore.zero.Init: module {type(module).__name__} has parameters of several dtypes "
                f"{sorted(map(str, dtypes))}; pass Init(dtype=...)"
            )
        dtype = self.dtype or params[0].dtype
        device = self.device or params[0].device
        values = [p.detach().to(device=device, dtype=dtype) for p in params]
        unit = FlatUnit(params, self.comm, dtype=dtype, device=device, name=type(module).__name__)
        unit.load_full(values)
        del values
        # every rank keeps rank 0's initialisation
        self.comm.broadcast(unit.full, self.comm.global_rank(0))
        unit.partition.copy_(unit.own_slice())
        unit.release()
        log.debug("zero.Init partitioned %s: %d elements, %d per rank", type(module).__name__, unit.numel, unit.chunk)


# torch calls that read only a tensor's metadata: a released parameter keeps its shape and dtype
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout", "names",
        "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "size", "dim", "numel", "element_size",
        "is_floating_point", "is_complex", "requires_grad_", "register_hook", "__hash__", "__eq__",
    }
)


def _call_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.shape.__get__
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return str(name)


class _GatherOnTouch(TorchFunctionMode):
    """Inside ``zero.Init``: a torch call on a released partitioned parameter gathers it (module doc)."""

    def __init__(self, init: Init) -> None:
        super().__init__()
        self.init = init

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        units: list[FlatUnit] = []
        if _call_name(func) not in _METADATA:
            for t in _tensors(args, kwargs):
                u = unit_of(t)
                if u is not None and not u.gathered and all(u is not v for v in units):
                    units.append(u)
        if not units:
            return func(*args, **kwargs)
        for u in units:
            u.gather()
        out = func(*args, **kwargs)
        params = {id(p) for u in units for p in u.params}
        storages = {u.full.untyped_storage().data_ptr(): u for u in units}
        for t in _tensors((out,), {}):
            if id(t) not in params and t.untyped_storage().data_ptr() in storages:
                self.init._held.append(storages.pop(t.untyped_storage().data_ptr()))  # a view escaped
        for u in units:
            if all(u is not h for h in self.init._held):
                self.init._publish(u)
        return out


def _tensors(args: Any, kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            stack.extend(a)


class GatheredParameters:
    """Context manager making partitioned parameters whole for reading or modification.

    Args:
        params: a parameter, an iterable of parameters, or a module (all its parameters). Parameters that
            are not partitioned are left alone.
        modifier_rank: None to read only: changes made inside the context are *discarded on every rank*
            at exit (DeepSpeed's documented rule), including for units that stay gathered (persistent
            small parameters), which are re-gathered from the untouched partitions so that no rank keeps
            a local edit the others do not see. Else the rank whose (possibly modified) values are
            broadcast to every rank and re-partitioned on exit (fp32 master weights of a live stage-3
            engine are refreshed through the unit's ``on_modified`` callbacks).
        fwd_module: DeepSpeed registers the parameters as external parameters of this module so that its
            forward finds them gathered; here they are held gathered for the whole context (the stage-3 hooks
            of any module's forward never release a held unit), which gives that effect, so nothing needs
            registering.
        enabled: False makes the context a no-op.

    Every rank of the group must enter the context (it runs collectives). Contexts nest and may overlap in
    any order: each unit counts the contexts holding it (``FlatUnit.holds``); a unit that a context found
    released is released again when the *last* context holding it exits, so an inner context never
    releases what an outer one holds, and a read-only inner context does not discard an outer
    ``modifier_rank`` context's pending writes. Units gathered by the training hooks or persistent ones
    stay gathered. When partitioned parameters are given, entering first
    checks that every rank arrived (:func:`dscore.comm.guard.ensure_all_arrived`, method
    ``"GatheredParameters"``): a rank that does not come within ``DSCORE_ARRIVAL_TIMEOUT`` seconds makes
    the others raise ``CollectiveArrivalError`` naming it.
    """

    def __init__(
        self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
    ) -> None:
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        if isinstance(params, torch.nn.Module):
            plist: Iterable[Any] = params.parameters()
        elif isinstance(params, torch.Tensor):
            plist = [params]
        else:
            plist = params
        units: list[FlatUnit] = []
        seen: set[int] = set()
        for p in plist:
            u = unit_of(p)
            if u is not None and id(u) not in seen:
                seen.add(id(u))
                units.append(u)
        self.units = units
        self._entered = False
        self._versions: list[tuple[torch.Tensor, int]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        if self._entered:
            raise RuntimeError("GatheredParameters: this context object is already entered; make a new one per with")
        if self.units:  # nothing partitioned: no collective, so no arrival check either
            from dscore.comm.guard import ensure_all_arrived

            ensure_all_arrived("GatheredParameters", group=self.units[0].comm.group)
        fresh = [not u.gathered for u in self.units]
        try:
            for u in self.units:
                u.gather(async_op=True)
            for u in self.units:
                u.wait()
        except BaseException:
            for u, f in zip(self.units, fresh):
                if f and u.holds == 0:
                    u.release()
            raise
        for u, f in zip(self.units, fresh):
            u.held_gather = u.held_gather or f
            u.holds += 1
        self._entered = True
        if self.modifier_rank is None:
            # in-place writes bump a tensor's version counter: comparing it at exit costs no copy
            self._versions = [(p, p._version) for u in self.units for p in u.params]
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.enabled or not self._entered:
            return
        self._entered = False
        for u in self.units:
            u.holds -= 1
        if self.modifier_rank is not None and exc_type is None:
            for u in self.units:
                u.comm.broadcast(u.full, u.comm.global_rank(self.modifier_rank))
                u.write_back()
        elif exc_type is None:
            _warn_discarded_writes(self._versions)
            # read-only: units that stay gathered get the partitions' values back, so an in-place edit on
            # some ranks cannot survive on those ranks only (no collective when leaving on an exception,
            # which may be raised on one rank only). Units an outer context still holds are that context's.
            kept = [u for u in self.units if u.holds == 0 and not u.held_gather]
            for u in kept:
                u.refresh(async_op=True)
            for u in kept:
                u.wait()
        self._versions = []
        for u in self.units:
            if u.holds == 0 and u.held_gather:
                u.held_gather = False
                u.release()


_DISCARDED_WRITE_WARNED = False


def _warn_discarded_writes(versions: list[tuple[torch.Tensor, int]]) -> None:
    """Warn once per process that ``GatheredParameters(modifier_rank=None)`` discards an in-place write.

    ``versions`` holds ``(parameter, its _version at entry)``. A write through ``p.data`` (a tensor with its
    own version counter) is not seen; ``with torch.no_grad(): p.copy_(...)`` and ``torch.nn.init`` are.
    """
    global _DISCARDED_WRITE_WARNED
    if _DISCARDED_WRITE_WARNED:
        return
    changed = [p for p, version in versions if p._version != version]
    if not changed:
        return
    _DISCARDED_WRITE_WARNED = True
    names = [str(getattr(p, _NAME_ATTR, None) or f"a {tuple(p.shape)} parameter") for p in changed[:3]]
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    log.warning(
        "GatheredParameters(modifier_rank=None) discarded in-place writes to %s%s: with modifier_rank=None the "
        "parameters are read-only and every rank keeps its partition's values (as in DeepSpeed); pass "
        "modifier_rank=0 to keep rank 0's values (warned once per process)",
        ", ".join(names),
        more,
    )
