"""ZeRO stages 1 and 2: optimizer state (1) and gradients (2) partitioned across data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5.1
(P_os) and §5.2 (P_os+g); the DeepSpeed behaviour mirrored is ``DeepSpeedZeroOptimizer``
(``deepspeed/runtime/zero/stage_1_and_2.py``), restated on a different layout:

**Layout.** Per optimizer parameter group, trainable parameters are taken in *reverse* registration
order (the order backward produces their gradients) and cut into *buckets* of about
``reduce_bucket_size`` elements. Each bucket is padded to a multiple of the world size and split into
``world`` equal chunks; rank ``r`` owns chunk ``r`` of every bucket (so ownership is balanced to within
one element per bucket whatever ``round_robin_gradients`` says: the option is accepted and has nothing
left to balance). The module's parameters become views into one flat buffer per group (bucket after
bucket). This rank's fp32 master weights, fp32 gradient partition and optimizer state are one flat
tensor per group: its chunks of the group's buckets back to back (``1/world`` of the group).

**Reduction.** A bucket's gradient is reduced with one ``reduce_scatter_tensor`` whose output is this
rank's chunk (or an all-reduce then a copy of the chunk with ``reduce_scatter: false``). Buckets are
launched strictly in bucket order on every rank (so collectives match even when ranks see gradients in
different orders or some parameters get none), asynchronously from gradient hooks when
``overlap_comm`` (overlapping backward), otherwise right after backward.

* Stage 1 keeps full gradients locally for the whole accumulation window (``contiguous_gradients``:
  ``.grad`` are views into one flat buffer per group, so autograd accumulates in place) and reduces once,
  at the boundary.
* Stage 2 reduces on every micro step: as each parameter's gradient is produced it is copied into its
  bucket's staging buffer and freed (``contiguous_gradients``; otherwise the per-parameter gradients live
  until their bucket launches), and the reduced chunk is accumulated into the fp32 partition. At most two
  buckets are in flight, so the full gradient never exists at once. ``no_sync`` is refused, as DeepSpeed
  does, because partitioned gradients cannot accumulate locally.

**Reduction keys.** ``gradient_allreduce_op: "sum"`` sums instead of averaging; ``prescale_gradients``
and ``gradient_predivide_factor`` choose where the division by the world size happens, with DeepSpeed's
rules (:func:`dscore.zero.reducer.gradient_divisors`; DeepSpeed refuses them with ``reduce_scatter``,
dscore honours them); ``communication_data_type`` is the dtype buckets are staged and reduced in (fp32
with bf16: the sum of the ranks' bf16 gradients is exact in the fp32 partitions).

**Step.** Unscale, overflow check and clipping by the *global* L2 norm (squared partition norms summed
with one scalar all-reduce) are one multiply of each fp32 partition; the optimizer steps the partitions
(on CPU with ``offload_optimizer.device: cpu``); each bucket's updated chunks are all-gathered straight
into the flat parameter buffer (``allgather_partitions``; in pieces of ``allgather_bucket_size``
elements; broadcasts from each owner when ``allgather_partitions: false``). Every bucket's gather is
launched asynchronously and all are waited for before ``step`` returns, so the parameters are current
whenever user code can see them (``engine.module.state_dict()`` or the tensors right after ``step``), as
in DeepSpeed; deferring the wait to the next forward's pre-hooks would leave them stale until then.
Under fp32 without offload the optimizer steps this rank's chunk of the parameter buffer in place (and
in stage 1 reads the reduced gradient from this rank's chunk of the gradient buffer): no fp32 copies.

Reduction runs on the shared :class:`dscore.zero.reducer.GradientReducer` (this module only decides
the buckets and where each reduced chunk goes); every collective goes through :class:`dscore.comm.Comm`,
which on gloo runs reduce-scatter and all-gather as pairwise point-to-point exchanges (a ring's volume,
measured faster there than gloo's own collectives). With ``offload_optimizer.device: cpu`` the optimizer step is
:func:`dscore_plugins.zero.offload.step_offloaded`; with ``nvme`` the masters and state live in swap
files between steps (:mod:`.nvme_optimizer`) and the step writes this rank's chunk of the parameter buffer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dscore.comm import Work
from dscore.errors import ConfigError, FragmentAccessError
from dscore.moe.checkpoint import ExpertNaming
from dscore.protocols.zero import ParamFragment, StepOutcome, ZeroStage, ZeroStageContext
from dscore.runtime.timers import active_timers, clock
from dscore.zero.layout import GroupLayout, Segment, chunk_fragment, load_partitioned_state, partitioned_state_dict
from dscore.zero.optimizer import build_optimizer, optimizer_state_bytes, unique_trainable
from dscore.zero.reducer import GradientReducer, ReduceBucket, comm_dtype_of, gradient_divisors
from dscore_plugins.zero.config import ZeroConfig
from dscore_plugins.zero.experts import globalize_state, group_comm
from dscore_plugins.zero.nvme_optimizer import attach as nvme_attach
from dscore_plugins.zero.nvme_optimizer import materialized as nvme_materialized
from dscore_plugins.zero.offload import host_tensor, offload_device, offload_pin
from dscore_plugins.zero.step import step_partitions

__all__ = ["PartitionedOptimizerStage"]

log = logging.getLogger("dscore.zero")

_MAX_INFLIGHT = 2


@torch.no_grad()
def _write_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Copy a full value into the module parameter (a view of the flat parameter buffer: every rank holds
    it whole, so writing the same value on every rank keeps the replicas equal)."""
    param.data.copy_(value.reshape(param.shape))


class PartitionBucket(ReduceBucket):
    """A reduce bucket of stages 1/2 plus where its parameters and this rank's fp32 chunks live.

    Attributes (beyond :class:`dscore.zero.reducer.ReduceBucket`):
        group: optimizer group index.
        data: view of the flat parameter buffer (``padded`` elements, compute dtype).
        master: this rank's fp32 master chunk (view of the group's master partition).
        master_grad: this rank's fp32 gradient chunk (the reducer's ``target``).
    """

    def __init__(self, index: int, group: int, params: list[torch.nn.Parameter], world: int) -> None:
        super().__init__(params, pad_to=world)
        self.index = index
        self.group = group
        self.data: torch.Tensor
        self.master: torch.Tensor
        self.master_grad: torch.Tensor
        self.comm: Any = None  # the group the bucket is partitioned over (set by the stage)
        self.world = world
        self.rank = 0


class PartitionedOptimizerStage(ZeroStage):
    """Shared implementation of stages 1 (``partition_gradients=False``) and 2 (True).

    Args:
        ctx: the engine's context. Reads ``zero_optimization.{reduce_bucket_size, allgather_bucket_size,
            overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions,
            round_robin_gradients, offload_optimizer, load_from_fp32_weights}``, ``gradient_clipping``,
            ``gradient_allreduce_op``, ``prescale_gradients``, ``gradient_predivide_factor`` and
            ``communication_data_type`` (validated models: ``ctx.section`` / ``ctx.config``).

    Raises:
        ConfigError: an unwritable ``offload_optimizer.nvme_path``; a parameter in two groups.
    """

    stage = 1
    supports_grad_norm_sq = True
    partition_gradients = False

    def __init__(self, ctx: ZeroStageContext[ZeroConfig]) -> None:
        super().__init__(ctx)
        zc = ctx.section
        self.comm = ctx.comm
        self.world, self.rank = self.comm.world_size, self.comm.rank
        self.reduce_bucket = zc.elements("reduce_bucket_size")
        self.allgather_bucket = int(zc.allgather_bucket_size)
        self.overlap = bool(zc.overlap_comm)
        self.contiguous = bool(zc.contiguous_gradients)
        self.use_reduce_scatter = bool(zc.reduce_scatter)
        self.allgather_partitions = bool(zc.allgather_partitions)
        self.round_robin = bool(zc.round_robin_gradients)
        self.load_from_fp32_weights = bool(zc.load_from_fp32_weights)
        self.offload = offload_device(zc.offload_optimizer, "offload_optimizer") in ("cpu", "nvme")
        self.pin = offload_pin(zc.offload_optimizer)
        self.clip = float(ctx.config.gradient_clipping)
        self.precision = ctx.precision
        self.loss_scaler = ctx.loss_scaler
        self.check_overflow = bool(ctx.precision.check_overflow)
        cfg = ctx.config
        # dscore's mean: fp16 averages before summing (no overflow), otherwise the division is folded
        # into the unscale/clip multiply of the step
        fp16 = self.precision.compute_dtype == torch.float16
        self.divisors = gradient_divisors(
            op=cfg.gradient_allreduce_op, prescale=bool(cfg.prescale_gradients),
            predivide=float(cfg.gradient_predivide_factor), world=self.world,
            default=(float(self.world), 1.0) if fp16 else (1.0, float(self.world)),
        )
        self.comm_dtype = comm_dtype_of(cfg.communication_data_type)

        self.group_params = unique_trainable(ctx.param_groups)
        # MoE expert groups are partitioned and reduced over their expert-data-parallel group
        self._group_comms = [self._comm_for(gi, params) for gi, params in enumerate(self.group_params)]
        names = {id(p): n for n, p in ctx.module.named_parameters()}
        self.buckets: list[PartitionBucket] = []
        self.flat_data: list[torch.Tensor | None] = []
        self.flat_grad: list[torch.Tensor | None] = []
        self.masters: list[list[torch.nn.Parameter]] = []  # per group: one flat chunk per bucket
        self.pairs: list[tuple[torch.nn.Parameter, GroupLayout]] = []
        self.master_grads: list[torch.Tensor] = []  # fp32 gradient partitions (buffers or chunk views)
        self._separate_masters: list[torch.Tensor] = []
        self._param_bucket: dict[int, tuple[PartitionBucket, int]] = {}
        self._pair_comms: dict[int, Any] = {}
        self._pair_ranks: dict[int, int] = {}
        for gi, params in enumerate(self.group_params):
            self._build_group(gi, params, names)
        self._optimizer = build_optimizer(ctx, self.masters, self.group_params)
        flat_masters = [m for ms in self.masters for m in ms]  # bucket order, as self.buckets
        self._bucket_master = {id(b): m for b, m in zip(self.buckets, flat_masters)}
        self._nvme = nvme_attach(ctx, self._optimizer, flat_masters,
                                 [b.data[b.rank * b.chunk : (b.rank + 1) * b.chunk] for b in self.buckets], self.rank)
        if self._nvme is not None:  # masters and state now live in swap files: drop the other references
            self._separate_masters.clear()
            for b, m in zip(self.buckets, flat_masters):
                b.master = m  # empty between steps; full inside nvme_materialized
        if self._optimizer is not None:
            self._optimizer.zero_grad = self._zero_grad_from_optimizer  # type: ignore[method-assign]
        # stage 2 (contiguous) copies each gradient into its bucket's staging buffer in the hook and frees
        # it; stage 1 keeps .grad as views of the flat gradient buffer (or stages them at launch)
        by_comm: dict[int, tuple[Any, list[PartitionBucket]]] = {id(self.comm): (self.comm, [])}
        for b in self.buckets:
            by_comm.setdefault(id(b.comm), (b.comm, []))[1].append(b)
        self._reducers = [
            GradientReducer(
                comm,
                buckets,
                reduce_scatter=self.use_reduce_scatter,
                copy_on_hook=self.partition_gradients and self.contiguous,
                free_grads=self.partition_gradients,
                ordered=True,
                max_inflight=_MAX_INFLIGHT,
                comm_dtype=self.comm_dtype,
            )
            for comm, buckets in by_comm.values()
        ]
        self.reducer = self._reducers[0]  # the data-parallel group's; the others reduce MoE expert groups
        self._hooks = (
            [h for r in self._reducers for h in r.register_hooks()] if (self.partition_gradients or self.overlap) else []
        )
        self._fresh = True  # gradient partitions hold nothing from this window yet
        self._reduced = False
        log.info(
            "ZeRO stage %d: %d bucket(s), %d elements/rank of %d, world=%d, overlap=%s, offload=%s",
            self.stage, len(self.buckets), sum(b.chunk for b in self.buckets),
            sum(sum(b.numels) for b in self.buckets), self.world, self.overlap, self.offload,
        )

    # ------------------------------------------------------------------ construction
    def _build_group(self, gi: int, params: list[torch.nn.Parameter], names: dict[int, str]) -> None:
        self.masters.append([])
        if not params:
            self.flat_data.append(None)
            self.flat_grad.append(None)
            return
        dtype, device = params[0].dtype, params[0].device
        # buckets in backward (reverse) order
        order = list(reversed(params))
        groups: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in order:
            if groups[-1] and size + p.numel() > self.reduce_bucket:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel()
        comm = self._group_comms[gi]
        buckets = [PartitionBucket(len(self.buckets) + i, gi, ps, comm.world_size) for i, ps in enumerate(groups)]
        for b in buckets:
            b.comm, b.world, b.rank = comm, comm.world_size, comm.rank
        total = sum(b.padded for b in buckets)
        flat = torch.zeros(total, dtype=dtype, device=device)
        grad = torch.zeros(total, dtype=dtype, device=device) if (self.contiguous and not self.partition_gradients) else None
        # fp32 without offload: the optimizer steps this rank's chunk of the parameter buffer in place
        # (and, in stage 1, reads its gradient from this rank's chunk of the gradient buffer): no copies.
        shared_master = dtype == torch.float32 and not self.offload
        shared_grad = shared_master and grad is not None
        part_numel = sum(b.chunk for b in buckets)
        accelerator = self.ctx.accelerator
        master = None if shared_master else (
            host_tensor(part_numel, torch.float32, self.pin, accelerator)
            if self.offload
            else torch.zeros(part_numel, dtype=torch.float32, device=device)
        )
        mgrad = None if shared_grad else (
            host_tensor(part_numel, torch.float32, self.pin, accelerator)
            if self.offload
            else torch.zeros(part_numel, dtype=torch.float32, device=device)
        )
        if master is not None:
            self._separate_masters.append(master)
        if mgrad is not None:
            self.master_grads.append(mgrad)
        start, poff = 0, 0
        with torch.no_grad():
            for b in buckets:
                b.data = flat[start : start + b.padded]
                if grad is not None:
                    b.grad = grad[start : start + b.padded]
                for k, (p, off, n) in enumerate(zip(b.params, b.offsets, b.numels)):
                    b.data[off : off + n].copy_(p.detach().reshape(-1))
                    p.data = b.data[off : off + n].view_as(p)
                    if b.grad is not None:
                        p.grad = b.grad[off : off + n].view_as(p)
                    else:
                        p.grad = None
                    self._param_bucket[id(p)] = (b, k)
                own = slice(b.rank * b.chunk, (b.rank + 1) * b.chunk)
                if master is None:
                    b.master = b.data[own]
                else:
                    b.master = master[poff : poff + b.chunk]
                    b.master.copy_(b.data[own])
                if mgrad is None:
                    assert b.grad is not None
                    b.master_grad = b.grad[own]
                    self.master_grads.append(b.master_grad)
                else:
                    b.master_grad = mgrad[poff : poff + b.chunk]
                b.target = b.master_grad
                mparam = torch.nn.Parameter(b.master, requires_grad=True)
                mparam.grad = b.master_grad
                layout = GroupLayout(
                    segments=[
                        Segment(
                            part_offset=0,
                            chunk=b.chunk,
                            names=[names.get(id(p), f"param_{id(p)}") for p in b.params],
                            offsets=list(b.offsets),
                            numels=list(b.numels),
                            shapes=[p.shape for p in b.params],
                        )
                    ],
                    numel=b.chunk,
                )
                self.masters[gi].append(mparam)
                self.pairs.append((mparam, layout))
                if comm is not self.comm:  # an MoE expert group: its partitions live on the EDP group
                    self._pair_comms[id(mparam)] = comm
                    self._pair_ranks[id(mparam)] = comm.rank
                start += b.padded
                poff += b.chunk
        self.buckets.extend(buckets)
        self.flat_data.append(flat)
        self.flat_grad.append(grad)

    # ------------------------------------------------------------------ contract
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def offload_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The default kinds plus the flat parameter / gradient buffers, the fp32 masters and gradient
        partitions, and the reducer's staging buffers (``contiguous_grad_buffer``)."""
        out = super().offload_state_tensors()
        out["lp_params"] += [t for t in self.flat_data if t is not None]
        out["hp_params"] += list(self._separate_masters)
        out["lp_grads"] += [t for t in self.flat_grad if t is not None] + list(self.master_grads)
        out["contiguous_grad_buffer"] += [t for r in self._reducers for t in r.buffers()]
        return out

    def _zero_grad_from_optimizer(self, set_to_none: bool = True) -> None:
        self._zero_buffers()  # keeps the .grad views: a direct loss.backward() may follow (engine.zero_grad() frees them)

    def _attach_grads(self) -> None:
        # stage 1 (contiguous): ``.grad`` are views of the flat gradient buffer; zero_grad() left them None
        self._grads_detached = False
        for b in self.buckets:
            if b.grad is not None:
                for p, off, n in zip(b.params, b.offsets, b.numels):
                    p.grad = b.grad[off : off + n].view_as(p)

    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        """Backward for one micro step; reduces as described in the module docstring.

        Raises:
            ConfigError: ``sync=False`` (``no_sync``) under stage 2.
        """
        if self.partition_gradients and not sync:
            raise ConfigError(
                "no_sync is incompatible with gradient partitioning (zero_optimization.stage 2): gradients "
                "are reduce-scattered on every micro step; use stage 0 or 1 for no_sync"
            )
        if getattr(self, "_grads_detached", False):
            self._attach_grads()
        timers = active_timers()
        reduce_now = sync and (self.partition_gradients or boundary)
        self._begin(launch=reduce_now and self.overlap, timed=timers is not None)
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            for r in self._reducers:
                r.end()
        if reduce_now:
            t0 = clock(timers)
            self._flush()
            if timers is not None:
                timers.add("backward.reduce_wait", clock(timers) - t0)
        if timers is not None:
            timers.add("backward.bucket", sum(r.copy_seconds for r in self._reducers))

    def _begin(self, *, launch: bool, timed: bool = False) -> None:
        # stage 2 adds a window's micro steps into the partitions
        prescale = self.divisors[0]
        accumulate = self.partition_gradients and not self._fresh
        for r in self._reducers:
            r.begin(launch=launch, prescale=prescale, accumulate=accumulate, timed=timed)

    def _flush(self) -> None:
        for r in self._reducers:
            r.flush()
        self._fresh = False
        self._reduced = True

    def step(self) -> StepOutcome:
        """Unscale, check overflow, clip by the global norm, step the partitions, all-gather, zero."""
        if not self.partition_gradients and not self._reduced:
            self._begin(launch=False)
            self._flush()
        return step_partitions(
            self._optimizer, masters=[m for ms in self.masters for m in ms], master_grads=self.master_grads, fresh=self._fresh,
            comm=self.comm, precision=self.precision, loss_scaler=self.loss_scaler, clip=self.clip, world=self.world,
            offload=self.offload, publish=self._all_gather_params, zero_grad=self._zero_buffers,
            post_divisor=self.divisors[1], norm_sq=self.grad_norm_sq,
        )

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """Write every rank's updated chunks into the flat parameter buffers.

        Every bucket is launched asynchronously (forward order: last bucket first), then all are waited
        for: the parameters are current when this returns.
        """
        pending: list[tuple[list[Work], torch.Tensor]] = []  # keeps each converted source alive until waited
        for b in reversed(self.buckets):
            # an empty master is on NVMe: its step already wrote the updated values into the own chunk
            comm, world, rank = b.comm, b.world, b.rank  # an MoE expert bucket: its expert-data-parallel group
            src = b.master if b.master.numel() else b.data[rank * b.chunk : (rank + 1) * b.chunk]
            if src.dtype != b.data.dtype or src.device != b.data.device:
                src = src.to(device=b.data.device, dtype=b.data.dtype, non_blocking=True)
            handles: list[Work] = []
            if world == 1:
                b.data.copy_(src)
            elif not self.allgather_partitions:
                b.data[rank * b.chunk : (rank + 1) * b.chunk].copy_(src)
                for q in range(world):
                    piece = b.data[q * b.chunk : (q + 1) * b.chunk]
                    handles.append(comm.broadcast(piece, comm.global_rank(q), async_op=True))
            elif b.padded <= self.allgather_bucket:
                handles.append(comm.all_gather_into_tensor(b.data, src, async_op=True))
            else:
                piece = max(1, self.allgather_bucket // world)
                for a in range(0, b.chunk, piece):
                    e = min(b.chunk, a + piece)
                    outs = [b.data[q * b.chunk + a : q * b.chunk + e] for q in range(world)]
                    handles.append(comm.all_gather(outs, src[a:e], async_op=True))
            if handles:
                pending.append((handles, src))
        for handles, _ in pending:
            for h in handles:
                h.wait()

    def zero_grad(self) -> None:
        """Drop accumulated gradients; every parameter's ``.grad`` is None afterwards (DeepSpeed), the flat
        buffers are zeroed and re-attached at the next ``backward``."""
        self._zero_buffers()
        if self.contiguous and not self.partition_gradients:
            for params in self.group_params:
                for p in params:
                    p.grad = None
            self._grads_detached = True

    def _zero_buffers(self) -> None:
        # after a step: zero in place, keep stage 1's ``.grad`` views (no per-parameter work per step)
        for r in self._reducers:
            r.reset()
        grads = [g for g in self.flat_grad if g is not None]
        if grads:
            torch._foreach_zero_(grads)
        if not self.contiguous or self.partition_gradients:
            for params in self.group_params:
                for p in params:
                    p.grad = None
        self._fresh = True
        self._reduced = False

    def param_fragment(self, param: torch.nn.Parameter) -> ParamFragment | None:
        """``param``'s elements in this rank's chunk of its bucket: views of the fp32 master chunk, of the
        fp32 gradient chunk (held from the reduction, at the boundary for stage 1 and every micro step for
        stage 2, until ``step``; the division by the world size is still pending unless fp16) and of the
        optimizer state of the bucket's master parameter; partitioned over the bucket's group.

        Raises:
            FragmentAccessError: ``param`` is not a parameter of the engine's module, or the masters live in
                NVMe swap files (``offload_optimizer: nvme``).
        """
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        hit = self._param_bucket.get(id(param))
        if hit is None:
            if id(param) in names:
                return None  # frozen: no master, gradient or optimizer state
            raise FragmentAccessError(
                f"the tensor (shape {tuple(param.shape)}) is not a parameter of this engine's module; pass one of "
                "engine.module.parameters()"
            )
        name = names.get(id(param), f"param_{id(param)}")
        if self._nvme is not None:
            raise FragmentAccessError(
                f"per-parameter access to {name!r}: with zero_optimization.offload_optimizer.device 'nvme' the fp32 "
                "masters and optimizer state live in swap files between steps; use offload_optimizer.device 'cpu' "
                "or 'none', or read the state with engine.save_checkpoint()"
            )
        b, k = hit
        start, cstart, n = chunk_fragment(b.offsets[k], b.numels[k], b.chunk, b.rank)
        return ParamFragment(
            name=name, shape=param.shape, start=start, numel=n, master=b.master[cstart : cstart + n],
            optimizer=self._optimizer, optimizer_param=self._bucket_master[id(b)], state_offset=cstart,
            grad=b.master_grad[cstart : cstart + n] if self._reduced else None, grad_divisor=float(self.divisors[1]),
            comm=b.comm, device=b.data.device, write_weights=lambda value: _write_param(param, value),
        )

    # ------------------------------------------------------------------ checkpoints

    def _comm_for(self, gi: int, params: list[torch.nn.Parameter]) -> Any:
        """The comm optimizer group ``gi`` is partitioned over (:func:`dscore_plugins.zero.experts.group_comm`).

        Raises:
            ConfigError: a group mixes expert parameters with others (or expert sizes).
        """
        return group_comm(self.comm, gi, params, getattr(self.ctx.runtime, "mesh", None))

    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed by parameter name (collective: call on every rank). MoE expert partitions are
        gathered over their expert-data-parallel group and every expert is named by its global index,
        gathered over the expert-parallel group (:mod:`dscore.moe.checkpoint`): loadable at any ep_size."""
        with nvme_materialized(self._optimizer):
            out = partitioned_state_dict(self._optimizer, self.pairs, self.comm, self.loss_scaler,
                                         comms=self._pair_comms)  # fmt: skip
        return globalize_state(self.ctx.module, out) if self._pair_comms else out

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Re-partition a state saved at any world size; refresh module weights from the fp32 masters."""
        naming = ExpertNaming(self.ctx.module) if self._pair_comms else None
        if naming:  # this rank's experts, under their local names
            state = dict(state)
            state["state"] = naming.localize(state.get("state", {}))
            if state.get("fp32_params"):
                state["fp32_params"] = naming.localize(state["fp32_params"])
        with nvme_materialized(self._optimizer, write_back=True):
            self._load_state_dict(state, load_optimizer_states=load_optimizer_states)

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool) -> None:
        load_partitioned_state(
            state, opt=self._optimizer, pairs=self.pairs, rank=self.rank, loss_scaler=self.loss_scaler,
            load_optimizer_states=load_optimizer_states,
            masters_loaded=lambda loaded: self._all_gather_params() if loaded else self._refresh_masters(),
            ranks=self._pair_ranks,
            load_fp32_masters=self.load_from_fp32_weights,
        )

    def _refresh_masters(self) -> None:
        with torch.no_grad():
            for b in self.buckets:
                own = b.data[b.rank * b.chunk : (b.rank + 1) * b.chunk]
                if own.data_ptr() != b.master.data_ptr():
                    b.master.copy_(own)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's own state dict (stages 1/2 hold full parameters); MoE experts under their global
        names, every rank's (collective over the expert-parallel group)."""
        sd = self.ctx.module.state_dict()
        naming = ExpertNaming(self.ctx.module) if self._pair_comms else None
        return type(sd)(naming.globalize(dict(sd))) if naming else sd

    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights in place (the flat buffers stay) and refresh the fp32 master partitions (MoE
        experts: this rank's, found under their global names)."""
        naming = ExpertNaming(self.ctx.module) if self._pair_comms else None
        self.ctx.module.load_state_dict(naming.localize(dict(state)) if naming else state, strict=strict)
        with nvme_materialized(self._optimizer, write_back=True):
            self._refresh_masters()

    def close(self) -> None:
        """Remove the NVMe swap files of ``offload_optimizer.device: nvme`` (``engine.close()``)."""
        if self._nvme is not None:
            self._nvme.close()

    def _aliases_flat_grad(self, g: torch.Tensor) -> bool:
        return any(
            f is not None and f.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() for f in self.flat_grad
        )

    def partition_bytes(self) -> dict[str, int]:
        """Bytes on this rank: optimizer state + fp32 masters, module parameters, gradients."""
        opt_bytes = optimizer_state_bytes(self._optimizer)
        masters = sum(m.numel() * 4 for m in self._separate_masters)
        params = sum(f.numel() * f.element_size() for f in self.flat_data if f is not None)
        grads = sum(g.numel() * g.element_size() for g in self.flat_grad if g is not None)
        grads += sum(g.numel() * g.element_size() for g in self.master_grads if g.grad_fn is None and not self._aliases_flat_grad(g))
        return {"optimizer_state": opt_bytes + masters, "parameters": params, "gradients": grads}
