"""ZeRO stage 3: parameters, gradients and optimizer state partitioned across data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5.3
(P_os+g+p); DeepSpeed behaviour mirrored: ``DeepSpeedZeroOptimizer_Stage3`` and its parameter
coordinator (``deepspeed/runtime/zero/stage3.py``, ``partitioned_param_coordinator.py``).

The stage is one class in four concepts: its units (:mod:`.units`), the gathering policy and module hooks
(:mod:`.coordinator`), the check that every rank ran the same modules (:mod:`.divergence`) and its state
(checkpoints and module state dicts, :mod:`.state`); this module assembles them and drives a micro step.

**Units** (:mod:`.units`): every module's direct parameters, split by optimizer group, are one
:class:`dscore.zero.partition.FlatUnit` of which this rank stores ``1/world``; an optimizer group's chunks
are one flat partition with the masters, gradients and optimizer state laid out alike. **Just-in-time
gathering** (:mod:`.coordinator`): module hooks gather, prefetch (``stage3_prefetch_bucket_size``,
``stage3_max_live_parameters``), keep for backward (``stage3_max_reuse_distance``) and release units;
units of at most ``stage3_param_persistence_threshold`` elements stay gathered for the whole run.

**Gather buffers on the host.** Released units give their memory to a
:class:`dscore.zero.buffer_cache.GatherBufferCache` and the next gather of the same size takes it back,
as the CUDA caching allocator keeps DeepSpeed's released blocks reserved on a GPU. Kept memory plus
gathered units never exceed the most that was gathered at once, and ``engine.empty_partition_cache()``
frees it. Without it every re-gather page-faults freshly mapped memory under the stage's allocation policy
(:func:`~dscore_plugins.zero.host_memory.apply_host_malloc_policy`): at hidden width 1024 that took
``forward.allgather_wait`` from 8.6 to 16.3 ms per step (``bench/dp_throughput.py``).

**Gradients.** Each trainable unit is one bucket of the shared
:class:`dscore.zero.reducer.GradientReducer`: as each parameter's gradient is produced it is copied into
the unit's staging buffer and freed; when a unit's trainable parameters are all done, one asynchronous
``reduce_scatter_tensor`` (an all-reduce with ``reduce_scatter: false``) sends every rank its chunk,
accumulated in fp32 (at most two units in flight; overlapped with backward when ``overlap_comm``, the
stage-3 default) and the unit is released. With ``zero_quantized_gradients`` (ZeRO++ qgZ, the
``zero_feature:qgz`` unit) that reduce-scatter is :class:`dscore_plugins.zeropp.qgz.QuantizedReduceScatter`
(int4 all-to-alls across nodes). The step is stage 1/2's: global-norm clip and unscale of the fp32
partitions, optimizer step (on CPU with ``offload_optimizer``), copy into the compute-dtype partition. ``offload_param: cpu`` keeps the
compute-dtype partitions in (pinned) host memory and copies them to the device for each gather;
``offload_param: nvme`` keeps each unit's partition in a swap file, resident only around its use
(:mod:`.nvme_params`), and ``offload_optimizer: nvme`` the masters and optimizer state (:mod:`.nvme_optimizer`).

**ZeRO++.** Each option is a ``zero_feature`` unit of the registry (``hpz``, ``qwz``, ``qgz``: the
built-in ``zeropp`` plugin), looked up only when its key is set: a disabled unit refuses that config with
the registry's error naming it. qwZ (``zero_quantized_weights``) is a unit's gather strategy
(:class:`dscore.zero.partition.GatherStrategy`): its training gathers send int8 blocks.
**hpZ** (``zero_hpz_partition_size``, :mod:`dscore_plugins.zeropp.hpz`): non-persistent units keep a
secondary partition from their construction and after each gather over the whole group; the other gathers
(backward, further micro steps) run inside blocks of that many contiguous ranks. The optimizer step drops
the trainable units' copies (frozen units keep theirs); gradients and the step are unchanged, so training
is ZeRO-3's bit for bit.

**Ranks running different modules.** Collectives are issued from module hooks in execution order, so
every rank must run the same modules. A ZeRO-3 *leaf* (``zero_optimization.leaf_module`` or
:func:`dscore.zero.set_z3_leaf_modules`; :mod:`dscore.zero.leaf`) gets the units of its whole subtree
gathered on entry and none of its submodules hooked, and its units are reduced by the final flush in unit
order (zeros for what a rank did not use): a mixture-of-experts block whose ranks skip different experts
is then exact. Without a leaf, ranks that ran different modules are refused after the micro step, before
an optimizer step uses the gradients (:mod:`.divergence`); gathers that differ in size fail earlier, in
the exchange itself, re-raised naming the module being entered and the same remedy.

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
from typing import Any

import torch

from dscore.errors import ConfigError, FragmentAccessError
from dscore.moe.utils import is_moe_param
from dscore.protocols.zero import ParamFragment, StepOutcome, ZeroStage, ZeroStageContext
from dscore.runtime.timers import active_timers, clock
from dscore.zero.buffer_cache import GatherBufferCache
from dscore.zero.layout import chunk_fragment
from dscore.zero.leaf import apply_leaf_module_config
from dscore.zero.optimizer import build_optimizer, optimizer_state_bytes, unique_trainable
from dscore.zero.reducer import GradientReducer, comm_dtype_of, gradient_divisors
from dscore.zero.released import name_parameters
from dscore_plugins.zero.config import ZeroConfig
from dscore_plugins.zero.coordinator import Coordinator, ModuleHook
from dscore_plugins.zero.experts import ReducerSet, group_comm, refuse_nvme_with_experts
from dscore_plugins.zero.host_memory import apply_host_malloc_policy
from dscore_plugins.zero.nvme_optimizer import attach as nvme_attach
from dscore_plugins.zero.nvme_params import attach as nvme_attach_params
from dscore_plugins.zero.offload import offload_device, offload_pin
from dscore_plugins.zero.param_offload import ParameterOffload, install_external_parameter_views
from dscore_plugins.zero.regions import choose_regions
from dscore_plugins.zero.state import StateIO
from dscore_plugins.zero.step import step_partitions
from dscore_plugins.zero.units import UnitBucket, UnitState

__all__ = ["Stage3", "Stage3ParameterManager", "apply_host_malloc_policy"]

log = logging.getLogger("dscore.zero")

_MAX_INFLIGHT = 2


def zero_feature(ctx: ZeroStageContext[ZeroConfig], name: str, key: str) -> Any:
    """The factory of the ``zero_feature`` unit ``name`` (a ZeRO++ option) that ``zero_optimization.<key>``
    asks for, resolved through the engine's registry.

    Raises:
        ComponentNotFoundError: the unit is disabled (names ``zero_feature:<name>`` and how to re-enable
            it) or not installed.
        PluginLoadError: its factory cannot be imported.
    """
    registry = ctx.runtime.registry
    return registry.load(registry.get("zero_feature", name, config_path=f"zero_optimization.{key}"))


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
        #: the stage's module-hook handle (:class:`~dscore_plugins.zero.param_offload.ParameterOffload`)
        self.parameter_offload = stage.parameter_offload

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


class Stage3(StateIO, Coordinator, ZeroStage):
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
    supports_grad_norm_sq = True

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
        # ZeRO++ qgZ (zero_feature:qgz): the gradient reduce-scatter as int4 all-to-alls across nodes (None: exact)
        self.qgz = (
            zero_feature(ctx, "qgz", "zero_quantized_gradients")(
                self.comm, local_world_size=self.comm.env.local_world_size if self.comm.env is not None else 0
            )
            if zc.zero_quantized_gradients
            else None
        )
        # ZeRO++ qwZ (zero_feature:qwz): builds a unit's int8 gather strategy (None: exact gathers)
        qwz_key = "zero_quantized_weights" if self.quantize_weights else "zero_quantized_nontrainable_weights"
        self.qwz = zero_feature(ctx, "qwz", qwz_key) if self.quantize_weights or self.quantize_frozen else None

        module = ctx.module
        # ZeRO++ hpZ (zero_feature:hpz): gathers read secondary partitions inside a smaller group
        hpz_size = int(zc.zero_hpz_partition_size)
        self.hpz = (
            zero_feature(ctx, "hpz", "zero_hpz_partition_size")(ctx.runtime, self.comm, hpz_size) if hpz_size > 1 else None
        )
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
        self.units: list[UnitState] = []
        self.by_unit: dict[int, UnitState] = {}
        self.module_units: dict[torch.nn.Module, list[UnitState]] = {}
        owner: dict[int, UnitState] = {}
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
        install_external_parameter_views(module)
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

        self._reset_coordinator()  # the forward trace (construction order until the first forward), nothing gathered
        self._fresh = True
        # the module hooks are optimizer.parameter_offload.forward_hooks (TRL removes and re-adds them)
        self.parameter_offload = ParameterOffload(self)
        self._regions: list[tuple[str, torch.nn.Module]] | None = None  # set by compile_regions (.regions)
        self._region_members = {}
        self.parameter_offload.forward_hooks = self._register_module_hooks()
        self._hooks: list[Any] = []
        # every trainable unit is one bucket; launched as soon as it is complete (every rank runs the same
        # graph, so units complete in the same order everywhere), and released right after the launch
        buckets = [
            UnitBucket(s, self.master_grads[s.key][s.part_offset : s.part_offset + s.unit.chunk], s.unit.world)
            for s in self.units
            if s.trainable
        ]
        for b in buckets:  # a leaf's units: the rank may not use all of them; reduced by flush, in order
            b.defer = id(b.state.unit) in self.leaf_units
        self._reset_collectives()  # this micro step's fingerprint (.divergence)
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
        if self._optimizer is not None:  # where DeepSpeed's stage-3 optimizer keeps it
            self._optimizer.parameter_offload = self.parameter_offload  # type: ignore[attr-defined]
        log.info(
            "ZeRO stage 3: %d unit(s), %d elements, %d per rank, %d persistent, world=%d, offload opt=%s param=%s",
            len(self.units), sum(s.unit.numel for s in self.units), sum(s.unit.chunk for s in self.units),
            sum(1 for s in self.units if s.unit.persistent), self.world, self.offload_opt, self.offload_param,
        )


    def _register_module_hooks(self) -> list[Any]:
        """Register the stage's forward pre/post hooks on every module owning units, and the root's
        post-forward check; returns their handles (:attr:`parameter_offload`'s ``forward_hooks``)."""
        module = self.ctx.module
        hooks: list[Any] = []
        inside = {id(m) for ms in self._region_members.values() for m in ms}
        for mod in self.module_units:
            if id(mod) in inside:  # compiled: its hooks run at its region's boundary
                continue
            hooks.append(mod.register_forward_pre_hook(ModuleHook(self._pre_forward)))
            hooks.append(mod.register_forward_hook(ModuleHook(self._post_forward)))
        for region in self._region_members:
            hooks.append(region.register_forward_pre_hook(ModuleHook(self._region_pre_forward)))
            hooks.append(region.register_forward_hook(ModuleHook(self._region_post_forward)))
        # a forward without autograd (evaluation) has no backward to check it: check at the model's end
        hooks.append(module.register_forward_hook(ModuleHook(self._root_post_forward)))
        return hooks

    def compile_regions(self) -> list[tuple[str, torch.nn.Module]]:
        """The regions ``engine.compile()`` compiles one by one (:mod:`dscore_plugins.zero.regions`); from this
        call on, the gather/release hooks of the modules inside a region run at that region's boundary."""
        if self._regions is None:
            chosen = choose_regions(self.ctx.module, list(self.module_units))
            self._regions = [(name, region) for name, region, _ in chosen]
            self._region_members = {region: members for _, region, members in chosen}
            offload = self.parameter_offload
            if offload.forward_hooks:  # hooks removed by a client (TRL's remove_hooks) stay removed
                for handle in offload.forward_hooks:
                    handle.remove()
                offload.forward_hooks = self._register_module_hooks()
            log.info("ZeRO stage 3 under torch.compile: %d compiled region(s): %s", len(self._regions),
                     ", ".join(name or "<root>" for name, _ in self._regions))
        return list(self._regions)

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


    def step(self) -> StepOutcome:
        """Unscale, overflow check, global-norm clip, optimizer step, refresh partitions, zero grads."""
        return step_partitions(
            self._optimizer, masters=[m for m in self.masters if m is not None], master_grads=self.master_grads, fresh=self._fresh,
            comm=self.comm, precision=self.precision, loss_scaler=self.loss_scaler, clip=self.clip, world=self.world,
            offload=self.offload_opt, publish=self._masters_to_partitions, zero_grad=self.zero_grad,
            post_divisor=self.divisors[1], norm_sq=self.grad_norm_sq,
        )

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

    def param_fragment(self, param: torch.nn.Parameter) -> ParamFragment | None:
        """``param``'s elements in this rank's chunk of its unit: views of the group's fp32 master partition,
        of its fp32 gradient partition (held from the first ``backward`` of a window until ``step``; the
        division by the world size still pending unless fp16) and of the optimizer state of the group's
        master; shape is the parameter's ``ds_shape``, partitioned over the unit's group.

        Raises:
            FragmentAccessError: ``param`` is not a parameter of the engine's module, or the masters live in
                NVMe swap files (``offload_optimizer: nvme``).
        """
        index = getattr(self, "_param_index", None)
        if index is None:
            index = self._param_index = {id(p): (s, i) for s in self.units for i, p in enumerate(s.unit.params)}
        hit = index.get(id(param))
        if hit is None or hit[0].unit.params[hit[1]] is not param:
            raise FragmentAccessError(
                f"the tensor ({type(param).__name__}) is not a parameter of this engine's module; pass one of "
                "engine.module.parameters()"
            )
        s, i = hit
        if not s.trainable:
            return None  # frozen: no master, gradient or optimizer state
        name = self.names.get(id(param), f"param_{id(param)}")
        master = self.masters[s.key]
        assert master is not None
        if self._nvme is not None:
            raise FragmentAccessError(
                f"per-parameter access to {name!r}: with zero_optimization.offload_optimizer.device 'nvme' the fp32 "
                "masters and optimizer state live in swap files between steps; use offload_optimizer.device 'cpu' "
                "or 'none', or read the state with engine.save_checkpoint()"
            )
        u = s.unit
        start, cstart, n = chunk_fragment(u.offsets[i], u.numels[i], u.chunk, u.rank)
        off = s.part_offset + cstart
        return ParamFragment(
            name=name, shape=u.shapes[i], start=start, numel=n, master=master.data[off : off + n],
            optimizer=self._optimizer, optimizer_param=master, state_offset=off,
            grad=None if self._fresh else self.master_grads[s.key][off : off + n],
            grad_divisor=float(self.divisors[1]), comm=u.comm, device=self.device,
            write_weights=lambda value: self._write_weights(s, i, value),
        )

    @torch.no_grad()
    def _write_weights(self, s: Any, i: int, value: torch.Tensor) -> None:
        """A full value of parameter ``i`` of unit ``s`` into this rank's compute-dtype partition and, while
        the unit is gathered, its full copy (every rank writes the same value: nothing to communicate)."""
        u = s.unit
        flat = value.reshape(-1)
        start, cstart, n = chunk_fragment(u.offsets[i], u.numels[i], u.chunk, u.rank)
        if n:
            target = self._partition_target(s.key)
            own = flat[start : start + n].to(self.compute_dtype)
            if isinstance(target, torch.Tensor):
                target[s.part_offset + cstart : s.part_offset + cstart + n].copy_(own)
            else:  # parameters on NVMe: a write into the unit's swap file
                target(s.part_offset + cstart, own)
        if u.gathered:
            u.full[u.offsets[i] : u.offsets[i] + u.numels[i]].copy_(flat)
        if self.hpz is not None:  # the unit's secondary partition is stale
            self.hpz.invalidate([u])

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
