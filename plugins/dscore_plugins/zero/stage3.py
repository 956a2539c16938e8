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

**Gather buffers on the host.** Released units give their memory to a
:class:`dscore.zero.buffer_cache.GatherBufferCache` and the next gather of the same size takes it back,
as the CUDA caching allocator keeps DeepSpeed's released blocks reserved on a GPU. Kept memory plus
gathered units never exceed the most that was gathered at once, and ``engine.empty_partition_cache()``
frees it. Without it every re-gather page-faults freshly mapped memory under the stage's allocation policy
(:func:`apply_host_malloc_policy`): at hidden width 1024 that took ``forward.allgather_wait`` from 8.6
to 16.3 ms per step (``bench/dp_throughput.py``).

**Gradients.** Each trainable unit is one bucket of the shared
:class:`dscore.zero.reducer.GradientReducer`: as each parameter's gradient is produced it is copied into
the unit's staging buffer and freed; when a unit's trainable parameters are all done, one asynchronous
``reduce_scatter_tensor`` (an all-reduce with ``reduce_scatter: false``) sends every rank its chunk,
accumulated in fp32 (at most two units in flight; overlapped with backward when ``overlap_comm``, the
stage-3 default) and the unit is released. With ``zero_quantized_gradients`` (ZeRO++ qgZ) that
reduce-scatter is :class:`dscore.zero.qgz.QuantizedReduceScatter` (int4 all-to-alls across nodes). The step is stage 1/2's: global-norm clip and unscale of the fp32 partitions, optimizer step (on
CPU with ``offload_optimizer``), copy into the compute-dtype partition. ``offload_param: cpu`` keeps the
compute-dtype partitions in (pinned) host memory and copies them to the device for each gather;
``offload_param: nvme`` keeps each unit's partition in a swap file, resident only around its use
(:mod:`.nvme_params`), and ``offload_optimizer: nvme`` the masters and optimizer state (:mod:`.nvme_optimizer`).

**ZeRO++ hpZ** (``zero_hpz_partition_size``, :mod:`dscore.zero.hpz`): non-persistent units keep a
secondary partition from their construction and after each gather over the whole group; the other gathers
(backward, further micro steps) run inside blocks of that many contiguous ranks. The optimizer step drops
the trainable units' copies (frozen units keep theirs); gradients and the step are unchanged, so training
is ZeRO-3's bit for bit.

**Ranks running different modules.** Collectives are issued from module hooks in execution order, so
every rank must run the same modules. A ZeRO-3 *leaf* (``zero_optimization.leaf_module`` or
:func:`dscore.zero.set_z3_leaf_modules`; :mod:`dscore.zero.leaf`) gets the units of its whole subtree
gathered on entry and none of its submodules hooked, and its units are reduced by the final flush in unit
order (zeros for what a rank did not use): a mixture-of-experts block whose ranks skip different experts
is then exact. Without a leaf, every gather and reduction of a micro step is folded into a fingerprint
(unit index and kind, rolling hash) compared across ranks with one 4-integer all-reduce after backward
(and after a forward without autograd): ranks that ran different modules raise ``DistributedError``
naming the first differing module on each rank and the block to flag, before an optimizer step uses the
gradients (measured: 0.28 ms per micro step on 2 gloo ranks of a loaded 2-core host). Gathers that differ
in size fail earlier, in the exchange itself; that error is re-raised naming the module being entered
and the same remedy.

**MoE experts** (:mod:`dscore.moe`). The units of an expert-parameter optimizer group are partitioned over
the expert-data-parallel group (:mod:`.experts`): gathered there, reduce-scattered there by a reducer of
their own (summed over that group, divided by the data-parallel world like every gradient), and
checkpointed with every expert under its global index. Every rank runs all its local experts (the layer's
all-to-all gives each a fixed-capacity buffer), so expert units are gathered and reduced in the same unit
order on every rank and the fingerprint check above holds as is.

``copy.deepcopy`` of the model (inside ``GatheredParameters``, for a reference or EMA copy) gives a plain
module: the stage's hooks deep-copy into no-op hooks.

Limitations (documented, raise nothing): a parameter used outside its owning module's forward (DeepSpeed's
"external parameters") must be gathered by the user with :class:`dscore.zero.GatheredParameters`;
``sub_group_size`` matters only with ``offload_optimizer: nvme`` (each group's partition is otherwise
stepped by one fused ``torch.optim`` call).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from dscore.errors import ConfigError, DistributedError
from dscore.moe.checkpoint import ExpertNaming
from dscore.moe.utils import is_moe_param
from dscore.protocols.zero import StepOutcome, ZeroStage, ZeroStageContext
from dscore.runtime.timers import active_timers, clock
from dscore.zero.buffer_cache import GatherBufferCache
from dscore.zero.hpz import build_hierarchical_partitioning
from dscore.zero.layout import GroupLayout, Segment, load_partitioned_state, partitioned_state_dict
from dscore.zero.leaf import apply_leaf_module_config, z3_leaf_module
from dscore.zero.optimizer import build_optimizer, optimizer_state_bytes, unique_trainable
from dscore.zero.partition import FlatUnit, unit_of
from dscore.zero.qgz import build as build_qgz
from dscore.zero.quantize import DEFAULT_BLOCK as QUANT_BLOCK
from dscore.zero.reducer import GradientReducer, ReduceBucket, comm_dtype_of, gradient_divisors
from dscore.zero.released import name_parameters
from dscore_plugins.zero.config import ZeroConfig
from dscore_plugins.zero.experts import (
    ReducerSet,
    expert_comm,
    globalize_state,
    group_comm,
    localize_state,
    refuse_nvme_with_experts,
)
from dscore_plugins.zero.nvme_optimizer import attach as nvme_attach
from dscore_plugins.zero.nvme_optimizer import materialized as nvme_materialized
from dscore_plugins.zero.nvme_optimizer import write_master as nvme_write_master
from dscore_plugins.zero.nvme_params import attach as nvme_attach_params
from dscore_plugins.zero.offload import host_tensor, offload_device, offload_pin
from dscore_plugins.zero.step import step_partitions

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
    (default 1 MiB); ``0`` disables the policy. It is the process policy ``malloc_mmap_threshold``
    (:mod:`dscore.process`: ``DSCORE_PROCESS_POLICIES`` can turn it off).

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

    from dscore import process

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

    def set_thresholds() -> bool:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) and libc.mallopt(
            _M_TRIM_THRESHOLD, ctypes.c_int(2 * threshold)
        ))

    try:
        ok = process.apply("malloc_mmap_threshold", set_thresholds)  # off: nothing changed (None)
    except (OSError, AttributeError):
        return 0
    if ok:
        log.debug("stage 3: glibc mmap threshold fixed at %d bytes (%s)", threshold, _MMAP_THRESHOLD_ENV)
    return threshold if ok else 0
_FROZEN = -1
_SEQ_MOD = (1 << 61) - 1
_SEQ_KEEP = 1 << 16


class _UnitState:
    """Training-time bookkeeping of one unit: its optimizer group and place in the group partition."""

    __slots__ = ("unit", "key", "trainable", "index", "part_offset")

    def __init__(self, unit: FlatUnit, key: int, index: int) -> None:
        self.unit = unit
        self.key = key
        self.index = index
        self.trainable = key != _FROZEN
        self.part_offset = 0


class UnitBucket(ReduceBucket):
    """The reduce bucket of one trainable unit (its gradients, padded like the unit's flat buffer)."""

    def __init__(self, state: _UnitState, target: torch.Tensor, pad_to: int) -> None:
        u = state.unit
        super().__init__(u.params, pad_to=pad_to, dtype=u.dtype, device=u.device, target=target, numels=u.numels)
        self.state = state


def _no_hook(*args: Any) -> None:
    """What a deep copy of a stage-3 module hook becomes (see :class:`_ModuleHook`)."""
    return None


class _ModuleHook:
    """A stage-3 forward (pre-)hook on a user module.

    ``copy.deepcopy(model)`` (e.g. inside ``GatheredParameters``, to make a reference or EMA model) copies
    the modules' hook dicts; a bound method there would deep-copy the whole stage, its comm and process
    group (``TypeError: cannot pickle 'module' object``). The copy instead gets a no-op hook: it is a plain
    module holding the values it was copied with, not managed by the engine.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _no_hook


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
        """Release every gathered, non-persistent unit and free its memory (partitions stay)."""
        self._stage.empty_partition_cache()

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
            offload_optimizer, offload_param, gather_16bit_weights_on_model_save, sub_group_size, leaf_module,
            load_from_fp32_weights, zero_quantized_weights, zero_quantized_nontrainable_weights,
            zero_hpz_partition_size, zero_quantized_gradients}``, ``gradient_clipping``, ``prescale_gradients``,
            ``gradient_predivide_factor`` and ``communication_data_type`` (validated models: ``ctx.section``
            / ``ctx.config``).

    Raises:
        ConfigError: an unwritable ``nvme_path`` or too small ``offload_param.buffer_size``; a parameter in two
            groups; ``zero_hpz_partition_size`` not dividing the ZeRO group's size.
    """

    stage = 3

    def __init__(self, ctx: ZeroStageContext[ZeroConfig]) -> None:
        super().__init__(ctx)
        zc = ctx.section
        self.comm = ctx.comm
        self.world, self.rank = self.comm.world_size, self.comm.rank
        self.overlap = bool(zc.overlap_comm)
        self.use_reduce_scatter = bool(zc.reduce_scatter)
        self.prefetch_bucket = zc.elements("prefetch_bucket_size")
        self.max_live = int(zc.max_live_parameters)
        self.max_reuse = int(zc.max_reuse_distance)
        self.persistence_threshold = zc.elements("param_persistence_threshold")
        self.gather_16bit_weights_on_model_save = bool(zc.gather_16bit_weights_on_model_save)
        self.sub_group_size = int(zc.sub_group_size)
        self.quantize_weights = bool(zc.zero_quantized_weights)
        self.quantize_frozen = bool(zc.zero_quantized_nontrainable_weights)
        self.load_from_fp32_weights = bool(zc.load_from_fp32_weights)
        self.offload_opt = offload_device(zc.offload_optimizer, "offload_optimizer") in ("cpu", "nvme")
        self.offload_param = offload_device(zc.offload_param, "offload_param") in ("cpu", "nvme")
        self.nvme_param = self.offload_param and zc.offload_param.device == "nvme"
        self.pin_opt = offload_pin(zc.offload_optimizer)
        self.pin_param = offload_pin(zc.offload_param)
        self.clip = float(ctx.config.gradient_clipping)
        self.precision = ctx.precision
        self.compute_dtype = ctx.precision.compute_dtype
        self.loss_scaler = ctx.loss_scaler
        self.check_overflow = bool(ctx.precision.check_overflow)
        cfg = ctx.config
        self.divisors = gradient_divisors(
            op=cfg.gradient_allreduce_op, prescale=bool(cfg.prescale_gradients),
            predivide=float(cfg.gradient_predivide_factor), world=self.world,
            default=(float(self.world), 1.0) if self.compute_dtype == torch.float16 else (1.0, float(self.world)),
        )
        self.comm_dtype = comm_dtype_of(cfg.communication_data_type)
        # ZeRO++ qgZ: the gradient reduce-scatter as int4 all-to-alls across nodes (None: exact)
        self.qgz = (
            build_qgz(self.comm, local_world_size=self.comm.env.local_world_size if self.comm.env is not None else 0)
            if zc.zero_quantized_gradients
            else None
        )

        module = ctx.module
        # ZeRO++ hpZ (dscore.zero.hpz): gathers read secondary partitions inside a smaller group
        self.hpz = build_hierarchical_partitioning(ctx.runtime, self.comm, int(zc.zero_hpz_partition_size))
        apply_leaf_module_config(module, zc.leaf_module)
        self.group_params = unique_trainable(ctx.param_groups)
        # MoE expert groups: partitioned, gathered and reduce-scattered over their expert-data-parallel group
        self._mesh = getattr(ctx.runtime, "mesh", None)
        self.group_comms = [group_comm(self.comm, gi, ps, self._mesh) for gi, ps in enumerate(self.group_params)]
        self.has_experts = any(is_moe_param(p) for p in module.parameters())
        if self.has_experts:
            refuse_nvme_with_experts(zc)
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
        self.module_names = {m: n for n, m in module.named_modules()}
        name_parameters(module)  # a released parameter's error names it ("lin.weight")
        self.leaf_units = self._merge_leaves(module)
        self.device = device or torch.device("cpu")
        if self.device.type == "cpu" or self.offload_param:
            apply_host_malloc_policy()
        # host gathers re-use released buffers (the CUDA caching allocator does this on a GPU)
        self.buffer_cache = GatherBufferCache() if self.device.type == "cpu" else None
        for s in self.units:
            s.unit.buffer_cache = self.buffer_cache
        self._consolidate()
        self._optimizer = build_optimizer(ctx, [[m] if m is not None else [] for m in self.masters], self.group_params)
        self._pairs = [(m, lay) for m, lay in zip(self.masters, self.layouts) if m is not None]
        # expert groups' partitions live on their expert-data-parallel group (checkpoint gather / scatter)
        self._pair_comms = {id(m): c for m, c in zip(self.masters, self.group_comms) if m is not None and c is not self.comm}
        self._pair_ranks = {k: c.rank for k, c in self._pair_comms.items()}
        self._pswap = nvme_attach_params(ctx, [s.unit for s in self.units if not s.unit.persistent], self.rank)
        if self._pswap is not None:  # partitions now live per unit: swap files (persistent units: own copies)
            for s in self.units:
                if s.unit.persistent:
                    s.unit.partition = s.unit.partition.clone()
            self.parts = {}
        self._nvme = nvme_attach(ctx, self._optimizer, [m for m in self.masters if m is not None],
                                 [self._partition_target(k) for k, m in enumerate(self.masters) if m is not None], self.rank)
        self._manager: Stage3ParameterManager | None = None
        if self._optimizer is not None:
            self._optimizer.zero_grad = self._zero_grad_from_optimizer  # type: ignore[method-assign]

        # trace (forward order of modules); construction order until the first forward is seen
        self._trace: list[torch.nn.Module] = list(self.module_units)
        self._recording: list[torch.nn.Module] | None = []
        self._trace_pos = {m: i for i, m in enumerate(self._trace)}
        self._gathered: OrderedDict[int, _UnitState] = OrderedDict()  # non-persistent, LRU order
        self._in_use: set[int] = set()
        self._fresh = True
        self._hooks: list[Any] = []
        self._may_evict = sum(s.unit.numel for s in self.units if not s.unit.persistent) > self.max_live
        for mod in self.module_units:
            self._hooks.append(mod.register_forward_pre_hook(_ModuleHook(self._pre_forward)))
            self._hooks.append(mod.register_forward_hook(_ModuleHook(self._post_forward)))
        # a forward without autograd (evaluation) has no backward to check it: check at the model's end
        self._hooks.append(module.register_forward_hook(_ModuleHook(self._root_post_forward)))
        # every trainable unit is one bucket; launched as soon as it is complete (every rank runs the same
        # graph, so units complete in the same order everywhere), and released right after the launch
        buckets = [
            UnitBucket(s, self.master_grads[s.key][s.part_offset : s.part_offset + s.unit.chunk], s.unit.world)
            for s in self.units
            if s.trainable
        ]
        for b in buckets:  # a leaf's units: the rank may not use all of them; reduced by flush, in order
            b.defer = id(b.state.unit) in self.leaf_units
        # the collectives of this micro step, (unit index, 0 gather / 1 reduce): compared across ranks
        self._collectives: list[tuple[int, int]] = []  # the first _SEQ_KEEP, for the error message
        self._seq_hash, self._seq_len = 0, 0
        by_comm: dict[int, tuple[Any, list[UnitBucket]]] = {id(self.comm): (self.comm, [])}
        for b in buckets:  # MoE expert units: one reducer per expert-data-parallel group
            by_comm.setdefault(id(b.state.unit.comm), (b.state.unit.comm, []))[1].append(b)
        if zc.zero_quantized_gradients and len(by_comm) > 1:
            raise ConfigError(
                "zero_optimization.zero_quantized_gradients (ZeRO++ qgZ) with MoE expert parameters under ZeRO stage 3 "
                "is not implemented (DeepSpeed 0.19.8 refuses it with AutoEP too); set zero_quantized_gradients to "
                "false for a model with expert parameters",
                path="zero_optimization.zero_quantized_gradients",
            )
        reducers = [
            GradientReducer(
                comm,
                bs,
                reduce_scatter=self.use_reduce_scatter,
                copy_on_hook=True,
                free_grads=True,
                ordered=False,
                max_inflight=_MAX_INFLIGHT,
                on_launched=self._reduce_launched,
                comm_dtype=self.comm_dtype,
                reduce_scatter_fn=self.qgz if comm is self.comm else None,
            )
            for comm, bs in by_comm.values()
        ]
        self.reducer: GradientReducer | ReducerSet = reducers[0] if len(reducers) == 1 else ReducerSet(reducers)
        self._hooks.extend(self.reducer.register_hooks())
        log.info(
            "ZeRO stage 3: %d unit(s), %d elements, %d per rank, %d persistent, world=%d, offload opt=%s param=%s",
            len(self.units), sum(s.unit.numel for s in self.units), sum(s.unit.chunk for s in self.units),
            sum(1 for s in self.units if s.unit.persistent), self.world, self.offload_opt, self.offload_param,
        )

    # ------------------------------------------------------------------ construction
    def _merge_leaves(self, module: torch.nn.Module) -> set[int]:
        """Give each outermost ZeRO-3 leaf module the units of its whole subtree and take its submodules'
        away (they get no hooks). Marks the leaf's parameters (``ds_z3_leaf_module``, as DeepSpeed).

        Returns:
            ``id`` of every unit inside a leaf.
        """
        inside: set[int] = set()
        done: set[torch.nn.Module] = set()
        for leaf in module.modules():
            if leaf in done or not z3_leaf_module(leaf):
                continue
            units: list[_UnitState] = []
            for sub in leaf.modules():
                done.add(sub)
                for st in self.module_units.pop(sub, []):
                    if st not in units:
                        units.append(st)
            for p in leaf.parameters():
                p.ds_z3_leaf_module = leaf  # type: ignore[attr-defined]
            if units:
                self.module_units[leaf] = units
                inside.update(id(st.unit) for st in units)
            log.info("ZeRO stage 3: %r (%s) is a leaf module: %d unit(s) gathered together",
                     self.module_names.get(leaf, "?"), type(leaf).__name__, len(units))
        return inside

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
        by_key: dict[tuple[int, int], tuple[int, Any, list[int]]] = {}
        for i, p in enumerate(params):
            key = key_of.get(id(p), _FROZEN)
            comm = self.group_comms[key] if key != _FROZEN else expert_comm(self.comm, p, self._mesh)
            by_key.setdefault((key, id(comm)), (key, comm, []))[2].append(i)
        for key, comm, idx in by_key.values():
            ps = [params[i] for i in idx]
            for p in ps:
                if hasattr(p, "ds_shape"):
                    del p.ds_shape
            unit = FlatUnit(ps, comm, dtype=self.compute_dtype, device=device, name=f"{type(mod).__name__}:{key}")
            unit.load_full([values[i] for i in idx])
            unit.persistent = unit.numel <= self.persistence_threshold
            if not unit.persistent and (self.quantize_weights or (self.quantize_frozen and key == _FROZEN)):
                # persistent units are gathered once per step: kept exact. Blocks of at most QUANT_BLOCK
                # elements that split this rank's chunk evenly (no padding beyond a few elements)
                blocks = -(-unit.chunk // QUANT_BLOCK)
                unit.quantize_block = -(-unit.chunk // blocks)
            if self.hpz is not None and not unit.persistent and unit.comm is self.comm:
                self.hpz.attach([unit], store=torch.device("cpu") if self.offload_param else None)
                unit.secondary.keep_initial()  # type: ignore[union-attr]  # kept from the first partitioning
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
                host_tensor(total, self.compute_dtype, self.pin_param, self.ctx.accelerator)
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
                not self.offload_opt and not self.nvme_param and self.compute_dtype == torch.float32
                and part.device == self.device
            )
            if shared:
                master = part
            elif self.offload_opt:
                master = host_tensor(total, torch.float32, self.pin_opt, self.ctx.accelerator)
                master.copy_(part)
            else:
                master = part.to(device=self.device, dtype=torch.float32).clone()
            mgrad = host_tensor(total, torch.float32, self.pin_opt, self.ctx.accelerator) if self.offload_opt else torch.zeros(
                total, dtype=torch.float32, device=master.device
            )
            mp = torch.nn.Parameter(master, requires_grad=True)
            mp.grad = mgrad
            self.masters[key] = mp
            self.master_grads[key] = mgrad
            if not shared:
                for s in members:
                    s.unit.on_modified.append(self._refresh_master_from)

    def _partition_target(self, key: int) -> Any:
        """Where group ``key``'s updated values go: its flat partition, or with parameters on NVMe a
        ``write(start, values)`` over its units' swap files."""
        if self._pswap is None:
            return self.parts[key]
        members = [s for s in self.units if s.key == key]
        units, offsets = [s.unit for s in members], [s.part_offset for s in members]
        return lambda start, values: self._pswap.write_range(units, offsets, start, values)  # type: ignore[union-attr]

    def _partition_values(self, key: int) -> torch.Tensor:
        """Group ``key``'s partition (with parameters on NVMe: read back unit by unit, a copy)."""
        if self._pswap is None:
            return self.parts[key]
        return torch.cat([self._pswap.read(s.unit) for s in self.units if s.key == key])

    def _refresh_master_from(self, unit: FlatUnit) -> None:
        s = self.by_unit[id(unit)]
        m = self.masters[s.key]
        if m is not None:
            nvme_write_master(self._optimizer, m, s.part_offset, unit.partition)  # in swap under NVMe offload

    # ------------------------------------------------------------------ gathering policy
    def _fetch(self, s: _UnitState, *, async_op: bool = False) -> None:
        u = s.unit
        if u.persistent:
            if not async_op:
                u.wait()
            return
        if not u.gathered:
            self._make_room(u.numel)
            self._note_collective(s.index, 0)
            u.gather(async_op=async_op, quantized=True)  # training gathers: ZeRO++ quantized when enabled
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
        if pos is not None and self._pswap is not None:  # start NVMe reads of the next units (buffer_count)
            order = self._trace[pos + 1 :] if direction > 0 else self._trace[pos - 1 :: -1] if pos > 0 else []
            self._pswap.prefetch(s.unit for m in order for s in self.module_units.get(m, []) if not s.unit.gathered)
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
        t0 = clock(timers)
        # launch this module's gathers and the prefetches before waiting, so all are in flight together
        try:
            for s in units:
                self._fetch(s, async_op=True)
            self._prefetch(mod, +1)
            for s in units:
                s.unit.wait()
        except DistributedError as exc:
            raise self._gather_failed(mod, exc) from exc
        if timers is not None:
            timers.add("forward.allgather_wait", clock(timers) - t0)

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

    def _root_post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            self._check_same_collectives()

    def _pre_backward(self, mod: torch.nn.Module) -> None:
        units = self.module_units[mod]
        for s in units:
            if s.trainable:
                self._in_use.add(id(s.unit))
            self._fetch(s, async_op=True)
        try:
            self._prefetch(mod, -1)
            for s in units:
                s.unit.wait()
        except DistributedError as exc:
            raise self._gather_failed(mod, exc) from exc

    def _gather_failed(self, mod: torch.nn.Module, exc: DistributedError) -> DistributedError:
        """A gather whose peers posted another collective (different sizes): most often ranks running
        different modules; say which module this rank was entering and how to make its block a leaf."""
        return DistributedError(
            f"{exc} [ZeRO stage 3 was gathering the parameters of {self.module_names.get(mod, '?')!r} "
            f"({type(mod).__name__}); if the ranks run different modules (e.g. experts of a mixture-of-experts "
            "block), flag the block as a ZeRO-3 leaf before dscore.initialize: zero_optimization.leaf_module "
            '{"classes": [...]} or dscore.zero.set_z3_leaf_modules(model, [BlockClass])]'
        )

    def _reduce_launched(self, b: ReduceBucket) -> None:
        assert isinstance(b, UnitBucket)
        self._note_collective(b.state.index, 1)
        self._in_use.discard(id(b.state.unit))
        self._release(b.state)

    # ------------------------------------------------------------------ contract
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def offload_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The default kinds plus this rank's compute-dtype partitions (``lp_params``) and the reducer's
        staging buffers (``contiguous_grad_buffer``); released gather buffers are freed first (their
        memory is a cache, as :meth:`empty_partition_cache`)."""
        self.empty_partition_cache()
        out = super().offload_state_tensors()
        out["lp_params"] += list(self.parts.values()) + [s.unit.partition for s in self.units]
        out["contiguous_grad_buffer"] += self.reducer.buffers()
        return out

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
        timers = active_timers()
        self.reducer.begin(launch=self.overlap, prescale=self.divisors[0], accumulate=not self._fresh, timed=timers is not None)
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self.reducer.end()
        t0 = clock(timers)
        # every rank reduces every trainable unit once per micro step, in unit order for the rest
        self.reducer.flush()
        if timers is not None:
            timers.add("backward.reduce_wait", clock(timers) - t0)
            timers.add("backward.bucket", self.reducer.copy_seconds)
        self._fresh = False
        self._in_use.clear()
        for s in list(self._gathered.values()):
            self._release(s)
        self._check_same_collectives()

    def _note_collective(self, index: int, kind: int) -> None:
        """Fold a gather (kind 0) or reduction (kind 1) of unit ``index`` into this micro step's fingerprint
        (a polynomial hash mod the Mersenne prime 2**61 - 1; forward-only use between backwards adds to
        it without growing memory beyond the first ``_SEQ_KEEP`` entries)."""
        self._seq_hash = (self._seq_hash * 1_000_003 + 2 * index + kind + 1) % _SEQ_MOD
        self._seq_len += 1
        if len(self._collectives) < _SEQ_KEEP:
            self._collectives.append((index, kind))

    def _check_same_collectives(self) -> None:
        """Refuse a micro step in which ranks issued different gathers/reductions (ran different modules).

        Stage 3 issues collectives from module hooks; a rank that skipped or added a module paired its
        collectives with other units on the other ranks, so its gradients are wrong. One all-reduce of a
        fingerprint per micro step (4 int64) detects that before any optimizer step uses them.

        Raises:
            DistributedError: the sequences differ; names the first differing module on each rank and
                how to make it a ZeRO-3 leaf (identical on every rank).
        """
        seq, self._collectives = self._collectives, []
        h, n = self._seq_hash, self._seq_len
        self._seq_hash, self._seq_len = 0, 0
        if self.world == 1:
            return
        fp = torch.tensor([h, n, -h, -n], dtype=torch.int64, device=self.device)
        self.comm.all_reduce(fp, op="max")
        if int(fp[0]) == -int(fp[2]) and int(fp[1]) == -int(fp[3]):
            return
        every = self.comm.all_gather_object(seq)
        raise DistributedError(self._divergence_message(every))

    def _unit_module(self, index: int) -> torch.nn.Module | None:
        u = self.units[index]
        return next((m for m, us in self.module_units.items() if u in us), None)

    def _divergence_message(self, every: list[list[tuple[int, int]]]) -> str:
        n = min(len(s) for s in every)
        pos = next((i for i in range(n) if len({s[i] for s in every}) > 1), n)
        kinds = ("gathered the parameters of", "reduced the gradients of")
        mods: list[torch.nn.Module] = []
        lines = []
        for r, s in enumerate(every):
            if pos < len(s):
                m = self._unit_module(s[pos][0])
                if m is not None:
                    mods.append(m)
                lines.append(f"rank {r} {kinds[s[pos][1]]} {self.module_names.get(m, '?')!r}" if m is not None
                             else f"rank {r} {kinds[s[pos][1]]} unit {s[pos][0]}")
            else:
                lines.append(f"rank {r} issued no more collectives")
        suggest = self._leaf_candidate(mods)
        hint = (
            f'zero_optimization.leaf_module {{"classes": ["{type(suggest).__name__}"]}} or '
            f"dscore.zero.set_z3_leaf_modules(model, [{type(suggest).__name__}]) (module "
            f"{self.module_names.get(suggest, '?')!r})"
            if suggest is not None
            else 'zero_optimization.leaf_module {"classes": [...]} or dscore.zero.set_z3_leaf_modules(model, [...])'
        )
        return (
            f"ZeRO stage 3: the ranks ran different modules in this micro step (collective #{pos}: "
            + "; ".join(lines)
            + "). Stage 3 gathers each module's parameters from its forward hook, so every rank must run the "
            "same modules in the same order; this micro step's gradients are wrong and no optimizer step was "
            "taken with them. Flag the block whose submodules run per rank (e.g. a mixture-of-experts block "
            f"skipping experts without tokens) as a ZeRO-3 leaf before dscore.initialize: {hint}."
        )

    def _leaf_candidate(self, mods: list[torch.nn.Module]) -> torch.nn.Module | None:
        """The innermost module containing all of ``mods`` that has its own forward (not a container)."""
        names = [self.module_names.get(m) for m in mods]
        if not names or any(n is None for n in names):
            return None
        parts = [n.split(".") if n else [] for n in names]  # type: ignore[union-attr]
        common: list[str] = []
        for segs in zip(*parts):
            if len(set(segs)) > 1:
                break
            common.append(segs[0])
        if len(set(names)) == 1:  # one module ran on some ranks only: its parent decides
            common = common[:-1]
        by_name = {n: m for m, n in self.module_names.items()}
        while True:
            m = by_name.get(".".join(common))
            if m is not None and not isinstance(m, torch.nn.ModuleList | torch.nn.ModuleDict):
                return m
            if not common:
                return None
            common.pop()

    def step(self) -> StepOutcome:
        """Unscale, overflow check, global-norm clip, optimizer step, refresh partitions, zero grads."""
        return step_partitions(
            self._optimizer, masters=[m for m in self.masters if m is not None], master_grads=self.master_grads, fresh=self._fresh,
            comm=self.comm, precision=self.precision, loss_scaler=self.loss_scaler, clip=self.clip, world=self.world,
            offload=self.offload_opt, publish=self._masters_to_partitions, zero_grad=self.zero_grad,
            post_divisor=self.divisors[1],
        )

    @torch.no_grad()
    def _masters_to_partitions(self) -> None:
        if self.hpz is not None:  # trainable partitions change: their hpZ copies are stale (frozen ones keep)
            self.hpz.invalidate(s.unit for s in self.units if s.trainable)
        for key, m in enumerate(self.masters):
            # an empty master is on NVMe: its step already wrote the partition
            if m is None or not m.numel():
                continue
            target = self._partition_target(key)
            if not isinstance(target, torch.Tensor):
                target(0, m.data)
            elif m.data.data_ptr() != target.data_ptr():
                target.copy_(m.data)
        persistent = [s.unit for s in self.units if s.unit.persistent]
        for u in persistent:
            u.refresh(async_op=True)
        for u in persistent:
            u.wait()

    def zero_grad(self) -> None:
        """Drop accumulated gradient partitions (and any staged or per-parameter gradients)."""
        self.reducer.reset()
        # released parameters guard value reads in __torch_function__ (dscore.zero.released); dropping .grad
        # reads no values, so it skips that dispatch (~6 us per parameter otherwise)
        with torch._C.DisableTorchFunctionSubclass():
            for s in self.units:
                for p in s.unit.params:
                    p.grad = None
        self._fresh = True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed by parameter name (collective: call on every rank)."""
        with nvme_materialized(self._optimizer):
            out = partitioned_state_dict(self._optimizer, self._pairs, self.comm, self.loss_scaler, comms=self._pair_comms)
        # MoE experts under their global names, every EP rank's: loadable at any ep_size
        return globalize_state(self.ctx.module, out) if self.has_experts else out

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Re-partition a state saved at any world size (fp32 masters also refresh the partitions; MoE
        experts: this rank's, found under their global names)."""
        if self.has_experts:
            state = localize_state(self.ctx.module, state)
        with nvme_materialized(self._optimizer, write_back=True):
            self._load_state_dict(state, load_optimizer_states=load_optimizer_states)

    def empty_partition_cache(self) -> None:
        """Release every gathered, non-persistent unit (not one in use by a running forward) and free the
        gather buffers kept for reuse and the ZeRO++ hpZ secondary partitions (the next gathers go over the
        whole group)."""
        for s in list(self._gathered.values()):
            if id(s.unit) not in self._in_use:
                self._release(s)
        if self.buffer_cache is not None:
            self.buffer_cache.empty()
        if self.hpz is not None:
            self.hpz.invalidate()

    def close(self) -> None:
        """Remove the NVMe swap files (``offload_optimizer`` / ``offload_param`` on nvme; ``engine.close()``)."""
        if self._nvme is not None:
            self._nvme.close()
        if self._pswap is not None:
            self._pswap.close()

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool) -> None:
        load_partitioned_state(
            state, opt=self._optimizer, pairs=self._pairs, rank=self.rank, loss_scaler=self.loss_scaler,
            load_optimizer_states=load_optimizer_states,
            masters_loaded=lambda loaded: self._masters_to_partitions() if loaded else self._partitions_to_masters(),
            ranks=self._pair_ranks,
            load_fp32_masters=self.load_from_fp32_weights,
        )

    def _partitions_to_masters(self) -> None:
        for key, m in enumerate(self.masters):
            if m is not None and (key not in self.parts or m.data.data_ptr() != self.parts[key].data_ptr()):
                m.data.copy_(self._partition_values(key))

    @torch.no_grad()
    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full state dict, gathered one unit at a time (collective: call on every rank). MoE experts are
        gathered over their expert-data-parallel group and named by their global index, every EP rank's
        (collective over the expert-parallel group, :mod:`dscore.moe.checkpoint`)."""
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
        out = OrderedDict((k, named[k]) for k in keys if k in named)
        return OrderedDict(ExpertNaming(module).globalize(dict(out))) if self.has_experts else out

    @torch.no_grad()
    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights: each unit is gathered, overwritten, re-partitioned (masters refreshed). MoE
        experts: this rank's, found under their global names.

        Raises:
            KeyError: ``strict`` and a parameter or buffer is missing from ``state`` (names it).
        """
        module = self.ctx.module
        if self.has_experts:
            state = ExpertNaming(module).localize(dict(state))
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
        opt_bytes = optimizer_state_bytes(self._optimizer)
        masters = sum(
            m.numel() * 4
            for key, m in enumerate(self.masters)
            if m is not None and (key not in self.parts or m.data.data_ptr() != self.parts[key].data_ptr())
        )
        params = sum(p.numel() * p.element_size() for p in self.parts.values())
        if self._pswap is not None:  # resident unit partitions (persistent ones and the NVMe cache)
            params += sum(s.unit.partition.numel() * s.unit.partition.element_size() for s in self.units)
        params += sum(s.unit.padded * s.unit.full.element_size() for s in self.units if s.unit.gathered)
        if self.hpz is not None:  # ZeRO++ hpZ secondary partitions
            params += self.hpz.nbytes()
        grads = sum(g.numel() * g.element_size() for g in self.master_grads)
        return {"optimizer_state": opt_bytes + masters, "parameters": params, "gradients": grads}
