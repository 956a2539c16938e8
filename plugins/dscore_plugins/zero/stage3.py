"""ZeRO stage 3: parameters, gradients and optimizer state partitioned across data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5.3
(P_os+g+p); DeepSpeed behaviour mirrored: ``DeepSpeedZeroOptimizer_Stage3`` and its parameter
coordinator (``deepspeed/runtime/zero/stage3.py``, ``partitioned_param_coordinator.py``).

**Units.** Every module's direct parameters (``recurse=False``), split by optimizer group (frozen
parameters form their own unit), become one :class:`dscore.zero.partition.FlatUnit`: a padded flat buffer
of which this rank permanently stores ``1/world`` (its chunk). Parameters built under
:class:`dscore.zero.Init` arrive already partitioned and are re-laid out one module at a time, so the full
model never exists on one rank. This rank's chunks of all units of an optimizer group are one flat
partition tensor; the fp32 master weights, fp32 gradient partition and optimizer state have the same
layout (the master *is* that partition under fp32 without offload).

**Just-in-time gathering.** A forward pre-hook gathers the module's units (waiting for a prefetch when
one is in flight) and prefetches the next units of the recorded forward order, up to
``stage3_prefetch_bucket_size`` elements, never beyond ``stage3_max_live_parameters`` gathered elements.
After forward, a unit is kept gathered for backward only if its next use is within
``stage3_max_reuse_distance`` elements of other fetches, otherwise released (storage freed); a hook on
the module's outputs re-gathers it (and prefetches the preceding units) just before its backward.
Units of at most ``stage3_param_persistence_threshold`` elements stay gathered for the whole run
(re-gathered after each step). The order is traced on the first forward (construction order before).

**Gradients.** As each parameter's gradient is produced it is copied into its unit's staging buffer and
freed; when a unit's trainable parameters are all done, one asynchronous ``reduce_scatter_tensor``
(an all-reduce with ``reduce_scatter: false``) sends every rank its chunk, accumulated in fp32 (at most
two units in flight; overlapped with backward when ``overlap_comm``, the stage-3 default) and the unit is
released. The step is stage 1/2's: global-norm clip and unscale of the fp32 partitions, optimizer step (on
CPU with ``offload_optimizer``), copy into the compute-dtype partition. ``offload_param: cpu`` keeps the
compute-dtype partitions in (pinned) host memory and copies them to the device for each gather.

Limitations (documented, raise nothing): every rank must run the same graph (collectives are issued
from hooks in execution order); a parameter used outside its owning module's forward (DeepSpeed's
"external parameters") must be gathered by the user with :class:`dscore.zero.GatheredParameters`;
``sub_group_size`` is accepted and not needed (each group's partition is stepped by one fused
``torch.optim`` call).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from dscore.errors import ConfigError
from dscore.runtime.timers import active_timers
from dscore.protocols.zero import StepOutcome, ZeroStage, ZeroStageContext
from dscore.zero._comm import Collectives, Handle
from dscore.zero.partition import FlatUnit, unit_of
from dscore_plugins.zero._common import (
    GroupLayout,
    Segment,
    build_optimizer,
    check_client_optimizer_for_offload,
    host_tensor,
    load_optimizer_state,
    offload_device,
    offload_pin,
    optimizer_state_dict,
    scatter_by_name,
    unique_trainable,
    unscale_clip,
    zero_section,
    zget,
)

__all__ = ["Stage3", "Stage3ParameterManager"]

log = logging.getLogger("dscore.zero")

_MAX_INFLIGHT = 2

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_ENV = "DSCORE_MALLOC_MMAP_THRESHOLD"
_DEFAULT_MMAP_THRESHOLD = 1 << 20  # bytes
_malloc_policy_applied = False


def apply_host_malloc_policy() -> int:
    """Make glibc return large freed host buffers to the OS (stage 3 on CPU calls it once per process).

    Stage 3 frees every gathered unit after use and gathers it again later. glibc serves a large
    allocation with ``mmap`` only until the first such block is freed; then it raises its mmap threshold
    (up to 32 MiB) and keeps later blocks of that size in the heap, where freed memory stays in the
    process: peak RSS grows by the released buffers. Fixing ``M_MMAP_THRESHOLD`` (which also turns the
    dynamic adjustment off) keeps every block of at least that many bytes on ``mmap``, returned on
    ``free``; ``M_TRIM_THRESHOLD`` is set to twice that so the heap top is trimmed too. This is an
    allocation strategy set once, not a per-step ``malloc_trim``.

    Scope: process-wide (it affects every allocation of the process), applied by the first stage-3
    engine whose parameters live on the CPU; other allocators (jemalloc/tcmalloc via ``LD_PRELOAD``)
    and non-glibc systems are left alone. ``DSCORE_MALLOC_MMAP_THRESHOLD`` sets the threshold in bytes
    (default 1 MiB); ``0`` disables the policy.

    Returns:
        the threshold applied in bytes, or 0 when nothing was changed.

    Raises:
        ConfigError: ``DSCORE_MALLOC_MMAP_THRESHOLD`` is not an integer.
    """
    global _malloc_policy_applied
    if _malloc_policy_applied:
        return 0
    import ctypes
    import os
    import platform
    import sys

    raw = os.environ.get(_MMAP_THRESHOLD_ENV, "").strip()
    try:
        threshold = int(raw) if raw else _DEFAULT_MMAP_THRESHOLD
    except ValueError:
        raise ConfigError(
            f"environment variable {_MMAP_THRESHOLD_ENV}={raw!r} must be an integer number of bytes (0 disables)"
        ) from None
    _malloc_policy_applied = True
    if threshold <= 0 or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) and libc.mallopt(
            _M_TRIM_THRESHOLD, ctypes.c_int(2 * threshold)
        )
    except (OSError, AttributeError):
        return 0
    if ok:
        log.debug("stage 3: glibc mmap threshold fixed at %d bytes (%s)", threshold, _MMAP_THRESHOLD_ENV)
    return threshold if ok else 0
_FROZEN = -1


class _UnitState:
    """Training-time bookkeeping of one unit (grad staging and readiness)."""

    __slots__ = ("unit", "key", "trainable", "index", "part_offset", "expected", "ready", "staging", "launched")

    def __init__(self, unit: FlatUnit, key: int, index: int) -> None:
        self.unit = unit
        self.key = key
        self.index = index
        self.trainable = key != _FROZEN
        self.part_offset = 0
        self.expected = len(unit.params) if self.trainable else 0
        self.ready = 0
        self.staging: torch.Tensor | None = None
        self.launched = False


class Stage3ParameterManager:
    """What ZeRO stage 3 returns as ``engine.optimizer`` when there is no optimizer (inference, evaluation).

    DeepSpeed returns its ``DeepSpeedZeRoOffload`` there rather than None, and scripts call methods on it;
    this object keeps parameters partitioned and offers what such a script needs. It does not step:
    ``engine.backward``/``engine.step`` still refuse to run without an optimizer.

    Attributes:
        param_groups: always ``[]`` (so ``engine.get_lr()`` is ``[]``).
    """

    def __init__(self, stage: Stage3) -> None:
        self._stage = stage
        self.param_groups: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full module state dict, gathered unit by unit (collective: call on every rank)."""
        return self._stage.module_state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full weights into the partitions (collective). Raises ``KeyError`` as
        :meth:`Stage3.load_module_state_dict`."""
        self._stage.load_module_state_dict(state, strict=strict)

    def gathered_parameters(self, params: Any = None, modifier_rank: int | None = None) -> Any:
        """A :class:`dscore.zero.GatheredParameters` over ``params`` (default: the whole module)."""
        from dscore.zero import GatheredParameters

        return GatheredParameters(self._stage.ctx.module if params is None else params, modifier_rank=modifier_rank)

    def partition_all_parameters(self) -> None:
        """Release every gathered, non-persistent unit (frees the full buffers; partitions stay)."""
        for s in list(self._stage._gathered.values()):
            self._stage._release(s)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradient partitions (nothing to drop unless backward ran through the module)."""
        self._stage.zero_grad()

    def __repr__(self) -> str:
        return f"Stage3ParameterManager(units={len(self._stage.units)}, world={self._stage.world})"


class Stage3(ZeroStage):
    """ZeRO stage 3 (see the module docstring).

    Args:
        ctx: the engine's context. Reads ``zero_optimization.{overlap_comm, reduce_scatter,
            prefetch_bucket_size, max_live_parameters, max_reuse_distance, param_persistence_threshold,
            offload_optimizer, offload_param, gather_16bit_weights_on_model_save, sub_group_size}``,
            ``gradient_clipping``, ``zero_force_ds_cpu_optimizer``.

    Raises:
        ConfigError: NVMe offload; a client optimizer unusable with CPU offload; a parameter in two groups.
    """

    stage = 3

    def __init__(self, ctx: ZeroStageContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        zc = zero_section(cfg)
        self.coll = Collectives(ctx.comm)
        self.world, self.rank = self.coll.world, self.coll.rank
        self.overlap = bool(zget(zc, "overlap_comm", True))
        self.use_reduce_scatter = bool(zget(zc, "reduce_scatter", True))
        self.prefetch_bucket = int(zget(zc, "prefetch_bucket_size", 50_000_000))
        self.max_live = int(zget(zc, "max_live_parameters", 1_000_000_000))
        self.max_reuse = int(zget(zc, "max_reuse_distance", 1_000_000_000))
        self.persistence_threshold = int(zget(zc, "param_persistence_threshold", 100_000))
        self.gather_16bit_weights_on_model_save = bool(zget(zc, "gather_16bit_weights_on_model_save", False))
        self.sub_group_size = int(zget(zc, "sub_group_size", 1_000_000_000))
        self.offload_opt = offload_device(zc, "offload_optimizer") == "cpu"
        self.offload_param = offload_device(zc, "offload_param") == "cpu"
        self.pin_opt = offload_pin(zc, "offload_optimizer")
        self.pin_param = offload_pin(zc, "offload_param")
        self.clip = float(getattr(cfg, "gradient_clipping", 0.0) or 0.0)
        self.precision = ctx.precision
        self.compute_dtype = ctx.precision.compute_dtype
        self.loss_scaler = ctx.loss_scaler
        self.check_overflow = bool(getattr(ctx.precision, "check_overflow", False))
        check_client_optimizer_for_offload(ctx, self.offload_opt)

        module = ctx.module
        self.group_params = unique_trainable(ctx.param_groups)
        key_of = {id(p): gi for gi, ps in enumerate(self.group_params) for p in ps}
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.units: list[_UnitState] = []
        self.by_unit: dict[int, _UnitState] = {}
        self.module_units: dict[torch.nn.Module, list[_UnitState]] = {}
        owner: dict[int, _UnitState] = {}
        device = None
        for mod in module.modules():
            direct = list(mod.parameters(recurse=False))
            new = [p for p in direct if id(p) not in owner]
            if new:
                device = self._make_units(mod, new, key_of, owner)
            units = []
            for p in direct:
                st = owner[id(p)]
                if st not in units:
                    units.append(st)
            if units:
                self.module_units[mod] = units
        self.device = device or torch.device("cpu")
        if self.device.type == "cpu" or self.offload_param:
            apply_host_malloc_policy()
        self._consolidate()
        self._optimizer = build_optimizer(ctx, [[m] if m is not None else [] for m in self.masters], self.group_params)
        self._pairs = [(m, lay) for m, lay in zip(self.masters, self.layouts) if m is not None]
        self._manager: Stage3ParameterManager | None = None
        if self._optimizer is not None:
            self._optimizer.zero_grad = self._zero_grad_from_optimizer  # type: ignore[method-assign]

        # trace (forward order of modules); construction order until the first forward is seen
        self._trace: list[torch.nn.Module] = list(self.module_units)
        self._recording: list[torch.nn.Module] | None = []
        self._trace_pos = {m: i for i, m in enumerate(self._trace)}
        self._gathered: OrderedDict[int, _UnitState] = OrderedDict()  # non-persistent, LRU order
        self._in_use: set[int] = set()
        self._inflight: list[tuple[_UnitState, Handle, torch.Tensor | None]] = []
        self._fresh = True
        self._pool: dict[int, list[torch.Tensor]] = {}  # padded size -> free gradient staging buffers
        self._hooks: list[Any] = []
        self._may_evict = sum(s.unit.numel for s in self.units if not s.unit.persistent) > self.max_live
        for mod in self.module_units:
            self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(mod.register_forward_hook(self._post_forward))
        for st in self.units:
            if st.trainable:
                for p in st.unit.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        log.info(
            "ZeRO stage 3: %d unit(s), %d elements, %d per rank, %d persistent, world=%d, offload opt=%s param=%s",
            len(self.units), sum(s.unit.numel for s in self.units), sum(s.unit.chunk for s in self.units),
            sum(1 for s in self.units if s.unit.persistent), self.world, self.offload_opt, self.offload_param,
        )

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def _make_units(
        self, mod: torch.nn.Module, params: list[torch.nn.Parameter], key_of: dict[int, int], owner: dict[int, _UnitState]
    ) -> torch.device:
        # full values of this module's parameters (gathering those built under zero.Init)
        init_units = []
        for p in params:
            u = unit_of(p)
            if u is not None and u not in init_units:
                init_units.append(u)
        for u in init_units:
            u.gather()
        values = [p.detach().to(self.compute_dtype).clone() for p in params]
        device = params[0].device
        for u in init_units:
            u.release()
        by_key: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            by_key.setdefault(key_of.get(id(p), _FROZEN), []).append(i)
        for key, idx in by_key.items():
            ps = [params[i] for i in idx]
            for p in ps:
                if hasattr(p, "ds_shape"):
                    del p.ds_shape
            unit = FlatUnit(ps, self.coll, dtype=self.compute_dtype, device=device, name=f"{type(mod).__name__}:{key}")
            unit.load_full([values[i] for i in idx])
            unit.persistent = unit.numel <= self.persistence_threshold
            if not unit.persistent:
                unit.release()
            st = _UnitState(unit, key, len(self.units))
            self.units.append(st)
            self.by_unit[id(unit)] = st
            for p in ps:
                owner[id(p)] = st
        return device

    @torch.no_grad()
    def _consolidate(self) -> None:
        """Move each unit's partition into one flat tensor per group; build masters and layouts."""
        keys = list(range(len(self.group_params))) + [_FROZEN]
        self.parts: dict[int, torch.Tensor] = {}
        self.layouts: list[GroupLayout] = [GroupLayout() for _ in self.group_params]
        self.masters: list[torch.nn.Parameter | None] = [None] * len(self.group_params)
        self.master_grads: list[torch.Tensor] = [torch.zeros(0) for _ in self.group_params]
        for key in keys:
            members = [s for s in self.units if s.key == key]
            if not members:
                continue
            total = sum(s.unit.chunk for s in members)
            part = (
                host_tensor(total, self.compute_dtype, self.pin_param)
                if self.offload_param
                else torch.zeros(total, dtype=self.compute_dtype, device=self.device)
            )
            off = 0
            layout = self.layouts[key] if key != _FROZEN else GroupLayout()
            for s in members:
                u = s.unit
                part[off : off + u.chunk].copy_(u.partition)
                u.partition = part[off : off + u.chunk]
                s.part_offset = off
                layout.segments.append(
                    Segment(
                        part_offset=off,
                        chunk=u.chunk,
                        names=[self.names.get(id(p), f"param_{id(p)}") for p in u.params],
                        offsets=list(u.offsets),
                        numels=list(u.numels),
                        shapes=list(u.shapes),
                    )
                )
                off += u.chunk
            layout.numel = total
            self.parts[key] = part
            if key == _FROZEN:
                continue
            shared = (
                not self.offload_opt and self.compute_dtype == torch.float32 and part.device == self.device
            )
            if shared:
                master = part
            elif self.offload_opt:
                master = host_tensor(total, torch.float32, self.pin_opt)
                master.copy_(part)
            else:
                master = part.to(device=self.device, dtype=torch.float32).clone()
            mgrad = host_tensor(total, torch.float32, self.pin_opt) if self.offload_opt else torch.zeros(
                total, dtype=torch.float32, device=master.device
            )
            mp = torch.nn.Parameter(master, requires_grad=True)
            mp.grad = mgrad
            self.masters[key] = mp
            self.master_grads[key] = mgrad
            if not shared:
                for s in members:
                    s.unit.on_modified.append(self._refresh_master_from)

    def _refresh_master_from(self, unit: FlatUnit) -> None:
        s = self.by_unit[id(unit)]
        m = self.masters[s.key]
        if m is not None:
            with torch.no_grad():
                m.data[s.part_offset : s.part_offset + unit.chunk].copy_(unit.partition)

    # ------------------------------------------------------------------ gathering policy
    def _fetch(self, s: _UnitState, *, async_op: bool = False) -> None:
        u = s.unit
        if u.persistent:
            if not async_op:
                u.wait()
            return
        if not u.gathered:
            self._make_room(u.numel)
            u.gather(async_op=async_op)
        elif not async_op:
            u.wait()
        self._gathered[id(u)] = s
        self._gathered.move_to_end(id(u))

    def _live(self) -> int:
        return sum(s.unit.numel for s in self._gathered.values())

    def _make_room(self, numel: int) -> None:
        live = self._live()
        if live + numel <= self.max_live:
            return
        for key in list(self._gathered):
            if live + numel <= self.max_live:
                break
            s = self._gathered[key]
            if key in self._in_use:
                continue
            self._release(s)
            live -= s.unit.numel

    def _release(self, s: _UnitState) -> None:
        if s.unit.persistent:
            return
        s.unit.release()
        self._gathered.pop(id(s.unit), None)

    def _prefetch(self, mod: torch.nn.Module, direction: int) -> None:
        pos = self._trace_pos.get(mod)
        if pos is None or self.prefetch_bucket <= 0:
            return
        budget = self.prefetch_bucket
        live = self._live()
        i = pos + direction
        while 0 <= i < len(self._trace):
            for s in self.module_units.get(self._trace[i], []):
                u = s.unit
                if u.persistent or u.gathered:
                    continue
                if u.numel > budget or live + u.numel > self.max_live:
                    return
                budget -= u.numel
                live += u.numel
                self._fetch(s, async_op=True)
            i += direction

    def _reuse_distance(self, mod: torch.nn.Module) -> int:
        """Elements fetched between this module's forward and its backward (rest of forward, twice)."""
        pos = self._trace_pos.get(mod)
        if pos is None:
            return 0
        after = sum(s.unit.numel for m in self._trace[pos + 1 :] for s in self.module_units.get(m, []))
        return 2 * after

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, mod: torch.nn.Module, args: Any) -> None:
        units = self.module_units[mod]
        if self._recording is not None and torch.is_grad_enabled():
            self._recording.append(mod)
        for s in units:
            self._in_use.add(id(s.unit))
        timers = active_timers()
        t0 = time.perf_counter()
        for s in units:
            self._fetch(s)
        self._prefetch(mod, +1)
        if timers is not None:
            timers.add("forward.allgather_wait", time.perf_counter() - t0)

    def _post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        units = self.module_units[mod]
        for s in units:
            self._in_use.discard(id(s.unit))
        grad = torch.is_grad_enabled()
        keep = grad and self._reuse_distance(mod) <= self.max_reuse
        # a unit kept for backward needs no re-gather unless max_live_parameters may evict it
        if grad and (not keep or self._may_evict):
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _g, m=mod: self._pre_backward(m), mode="any"
                )
        if not keep:
            for s in units:
                self._release(s)

    def _pre_backward(self, mod: torch.nn.Module) -> None:
        units = self.module_units[mod]
        for s in units:
            if s.trainable:
                self._in_use.add(id(s.unit))
            self._fetch(s)
        self._prefetch(mod, -1)

    def _grad_ready(self, p: torch.Tensor) -> None:
        u = unit_of(p)
        assert u is not None and p.grad is not None
        s = self.by_unit[id(u)]
        if s.staging is None:
            s.staging = self._acquire(u)
        k = next(i for i, q in enumerate(u.params) if q is p)
        s.staging[u.offsets[k] : u.offsets[k] + u.numels[k]].copy_(p.grad.reshape(-1))
        p.grad = None
        s.ready += 1
        if s.ready >= s.expected and self.overlap:
            self._launch(s)

    def _launch(self, s: _UnitState) -> None:
        if s.launched:
            return
        while len(self._inflight) >= _MAX_INFLIGHT:
            self._finish(*self._inflight.pop(0))
        u = s.unit
        if s.staging is None:
            s.staging = self._acquire(u)
        inp = s.staging
        if self.world > 1 and self.compute_dtype == torch.float16:
            inp.div_(self.world)
        if self.use_reduce_scatter:
            out = torch.empty(u.chunk, dtype=inp.dtype, device=inp.device)
            h = self.coll.reduce_scatter(out, inp, async_op=True)
        else:
            h = self.coll.all_reduce(inp, async_op=True)
            out = inp[self.rank * u.chunk : (self.rank + 1) * u.chunk]
        s.launched = True
        self._inflight.append((s, h, out))
        self._in_use.discard(id(u))
        self._release(s)

    def _acquire(self, u: FlatUnit) -> torch.Tensor:
        """A zeroed gradient staging buffer of ``u.padded`` elements, reused across micro steps (keeps
        large allocations off the allocator's hot path)."""
        pool = self._pool.get(u.padded)
        if pool:
            return pool.pop().zero_()
        return torch.zeros(u.padded, dtype=self.compute_dtype, device=self.device)

    def _recycle(self, s: _UnitState) -> None:
        if s.staging is not None:
            pool = self._pool.setdefault(s.unit.padded, [])
            if len(pool) < _MAX_INFLIGHT:
                pool.append(s.staging)
            s.staging = None

    def _finish(self, s: _UnitState, h: Handle, out: torch.Tensor | None) -> None:
        h.wait()
        g = self.master_grads[s.key][s.part_offset : s.part_offset + s.unit.chunk]
        assert out is not None
        if self._fresh:
            g.copy_(out)
        else:
            g.add_(out)
        self._recycle(s)

    # ------------------------------------------------------------------ contract
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @property
    def public_optimizer(self) -> Any:
        """The optimizer, or a :class:`Stage3ParameterManager` when there is none."""
        if self._optimizer is not None:
            return self._optimizer
        if self._manager is None:
            self._manager = Stage3ParameterManager(self)
        return self._manager

    def _zero_grad_from_optimizer(self, set_to_none: bool = True) -> None:
        self.zero_grad()

    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        """Backward for one micro step; every trainable unit's gradient is reduce-scattered once.

        Raises:
            ConfigError: ``sync=False`` (``no_sync`` cannot work with partitioned gradients).
        """
        if not sync:
            raise ConfigError(
                "no_sync is incompatible with gradient partitioning (zero_optimization.stage 3); "
                "use stage 0 or 1 for no_sync"
            )
        if self._recording is not None:
            if self._recording:
                self._trace = list(dict.fromkeys(self._recording))
                self._trace_pos = {m: i for i, m in enumerate(self._trace)}
            self._recording = None
        for s in self.units:
            s.ready = 0
            s.launched = False
        loss.backward(retain_graph=retain_graph)
        timers = active_timers()
        t0 = time.perf_counter()
        # every rank reduces every trainable unit once per micro step, in unit order for the rest
        for s in self.units:
            if s.trainable and not s.launched:
                self._launch(s)
        while self._inflight:
            self._finish(*self._inflight.pop(0))
        if timers is not None:
            timers.add("backward.reduce_wait", time.perf_counter() - t0)
        self._fresh = False
        self._in_use.clear()
        for s in list(self._gathered.values()):
            self._release(s)

    def step(self) -> StepOutcome:
        """Unscale, overflow check, global-norm clip, optimizer step, refresh partitions, zero grads."""
        if self._fresh:
            for g in self.master_grads:
                g.zero_()
        timers = active_timers()
        t0 = time.perf_counter()
        scale = float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0
        divisor = scale * (1.0 if self.compute_dtype == torch.float16 else float(self.world))
        flats = [g for g in self.master_grads if g.numel()]
        norm, overflow = unscale_clip(flats, self.coll, divisor=divisor, clip=self.clip, check_overflow=self.check_overflow)
        skip = self.loss_scaler.update(overflow) if self.loss_scaler is not None else overflow
        if skip or overflow:
            self.zero_grad()
            return StepOutcome(applied=False, overflow=overflow, global_grad_norm=None)
        t1 = time.perf_counter()
        if self._optimizer is not None:
            self._optimizer.step()
            t2 = time.perf_counter()
            self._masters_to_partitions()
            if timers is not None:
                timers.add("step.optimizer", t2 - t1)
                timers.add("step.allgather", time.perf_counter() - t2)
        if timers is not None:
            timers.add("step.clip", t1 - t0)
        self.zero_grad()
        return StepOutcome(applied=True, overflow=False, global_grad_norm=norm)  # type: ignore[arg-type]

    @torch.no_grad()
    def _masters_to_partitions(self) -> None:
        for key, m in enumerate(self.masters):
            if m is not None and m.data.data_ptr() != self.parts[key].data_ptr():
                self.parts[key].copy_(m.data)
        persistent = [s.unit for s in self.units if s.unit.persistent]
        for u in persistent:
            u.refresh(async_op=True)
        for u in persistent:
            u.wait()

    def zero_grad(self) -> None:
        """Drop accumulated gradient partitions (and any staged or per-parameter gradients)."""
        while self._inflight:
            s, h, _ = self._inflight.pop(0)
            h.wait()
            self._recycle(s)
        for s in self.units:
            self._recycle(s)
            s.launched = False
            s.ready = 0
            for p in s.unit.params:
                p.grad = None
        self._fresh = True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed by parameter name (collective: call on every rank)."""
        state, groups, fp32 = optimizer_state_dict(self._optimizer, self._pairs, self.coll)
        out: dict[str, Any] = {
            "param_names": [n for lay in self.layouts for n in lay.names],
            "state": state,
            "param_groups": groups,
            "fp32_params": fp32,
        }
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Re-partition a state saved at any world size (fp32 masters also refresh the partitions)."""
        fp32 = state.get("fp32_params") if load_optimizer_states else None
        if fp32:
            for m, lay in self._pairs:
                scatter_by_name(fp32, lay, self.rank, m.data)
            self._masters_to_partitions()
        else:
            for key, m in enumerate(self.masters):
                if m is not None and m.data.data_ptr() != self.parts[key].data_ptr():
                    m.data.copy_(self.parts[key])
        if not load_optimizer_states:
            return
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self._optimizer is not None:
            load_optimizer_state(self._optimizer, self._pairs, state, self.rank)

    @torch.no_grad()
    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full state dict, gathered one unit at a time (collective: call on every rank)."""
        module = self.ctx.module
        keys = list(module.state_dict(keep_vars=True).keys())
        values: dict[int, torch.Tensor] = {}
        for s in self.units:
            u = s.unit
            was = u.gathered
            u.gather()
            for p, v in zip(u.params, u.full_values()):
                values[id(p)] = v.clone()
            if not was:
                u.release()
        named: dict[str, torch.Tensor] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            named[n] = values[id(p)]
        for n, b in module.named_buffers(remove_duplicate=False):
            named[n] = b.detach().clone()
        return OrderedDict((k, named[k]) for k in keys if k in named)

    @torch.no_grad()
    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights: each unit is gathered, overwritten, re-partitioned (masters refreshed).

        Raises:
            KeyError: ``strict`` and a parameter or buffer is missing from ``state`` (names it).
        """
        module = self.ctx.module
        names_of: dict[int, list[str]] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(n)
        for s in self.units:
            u = s.unit
            was = u.gathered
            u.gather()
            for p, v in zip(u.params, u.full_values()):
                name = next((n for n in names_of.get(id(p), []) if n in state), None)
                if name is None:
                    if strict:
                        raise KeyError(f"state dict has no entry for parameter {names_of.get(id(p), ['?'])[0]!r}")
                    continue
                v.copy_(state[name].reshape(v.shape))
            u.write_back()
            if s.trainable and self.masters[s.key] is not None:
                self._refresh_master_from(u)
            if not was:
                u.release()
        for n, b in module.named_buffers():
            if n in state:
                b.copy_(state[n])
            elif strict:
                raise KeyError(f"state dict has no entry for buffer {n!r}")

    def partition_bytes(self) -> dict[str, int]:
        """Bytes on this rank: optimizer state (+ separate fp32 masters), parameter partitions and
        persistent/live full units, fp32 gradient partitions."""
        opt_bytes = 0
        if self._optimizer is not None:
            for st in self._optimizer.state.values():
                opt_bytes += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        masters = sum(
            m.numel() * 4
            for key, m in enumerate(self.masters)
            if m is not None and m.data.data_ptr() != self.parts[key].data_ptr()
        )
        params = sum(p.numel() * p.element_size() for p in self.parts.values())
        params += sum(s.unit.padded * s.unit.full.element_size() for s in self.units if s.unit.gathered)
        grads = sum(g.numel() * g.element_size() for g in self.master_grads)
        return {"optimizer_state": opt_bytes + masters, "parameters": params, "gradients": grads}
