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

**Step.** Unscale, overflow check and clipping by the *global* L2 norm (squared partition norms summed
with one scalar all-reduce) are one multiply of each fp32 partition; the optimizer steps the partitions
(on CPU with ``offload_optimizer.device: cpu``); each bucket's updated chunks are all-gathered straight
into the flat parameter buffer (``allgather_partitions``; in pieces of ``allgather_bucket_size``
elements; broadcasts from each owner when ``allgather_partitions: false``). Under ``overlap_comm`` that
gather is not waited for in ``step``: each module's forward pre-hook waits only for the buckets holding
its own parameters, so the gather overlaps the next forward (checkpoint and load paths wait for all).
Under fp32 without offload the optimizer steps this rank's chunk of the parameter buffer in place (and
in stage 1 reads the reduced gradient from this rank's chunk of the gradient buffer): no fp32 copies.

On gloo the collectives adapter (:mod:`dscore.zero._comm`) runs reduce-scatter as an in-place
all-reduce and all-gather as one broadcast per owner, both exact and measured faster there.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dscore.errors import ConfigError
from dscore.runtime.timers import active_timers
from dscore.protocols.zero import StepOutcome, ZeroStage, ZeroStageContext
from dscore.zero._comm import Collectives, Handle
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

__all__ = ["PartitionedOptimizerStage"]

log = logging.getLogger("dscore.zero")

_DEFAULT_BUCKET = 500_000_000
_MAX_INFLIGHT = 2


class _Bucket:
    """One reduce bucket: a slice of its group's flat parameter buffer (and gradient buffer in stage 1).

    Attributes:
        index: global bucket index (launch order).
        group: optimizer group index.
        params: parameters in layout order.
        offsets, numels: positions inside the padded bucket (elements).
        chunk: elements per rank; ``padded = chunk * world``.
        data: view of the flat parameter buffer (``padded`` elements, compute dtype).
        grad: view of the flat gradient buffer (stage 1 with contiguous gradients) or None.
        master: this rank's fp32 master chunk (view of the group's master partition).
        master_grad: this rank's fp32 gradient chunk (view of the group's gradient partition).
    """

    __slots__ = (
        "index", "group", "params", "offsets", "numels", "chunk", "padded", "data", "grad", "master",
        "master_grad", "ready", "expected", "staging", "handle", "out", "launched", "got",
    )

    def __init__(self, index: int, group: int, params: list[torch.nn.Parameter], world: int) -> None:
        self.index = index
        self.group = group
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = []
        off = 0
        for n in self.numels:
            self.offsets.append(off)
            off += n
        self.chunk = max(1, -(-off // world))
        self.padded = self.chunk * world
        self.data: torch.Tensor
        self.grad: torch.Tensor | None = None
        self.master: torch.Tensor
        self.master_grad: torch.Tensor
        self.ready = 0
        self.expected = len(params)
        self.staging: torch.Tensor | None = None
        self.handle: Handle | None = None
        self.out: torch.Tensor | None = None
        self.launched = False
        self.got: list[bool] = [False] * len(params)


class PartitionedOptimizerStage(ZeroStage):
    """Shared implementation of stages 1 (``partition_gradients=False``) and 2 (True).

    Args:
        ctx: the engine's context. Reads ``zero_optimization.{reduce_bucket_size, allgather_bucket_size,
            overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions,
            round_robin_gradients, offload_optimizer}``, ``gradient_clipping`` and
            ``zero_force_ds_cpu_optimizer``.

    Raises:
        ConfigError: offload to NVMe; a client optimizer that cannot step CPU partitions under offload;
            a parameter in two groups.
    """

    stage = 1
    partition_gradients = False

    def __init__(self, ctx: ZeroStageContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        zc = zero_section(cfg)
        self.coll = Collectives(ctx.comm)
        self.world, self.rank = self.coll.world, self.coll.rank
        self.reduce_bucket = max(1, int(zget(zc, "reduce_bucket_size", _DEFAULT_BUCKET)))
        self.allgather_bucket = max(1, int(zget(zc, "allgather_bucket_size", _DEFAULT_BUCKET)))
        self.overlap = bool(zget(zc, "overlap_comm", False))
        self.contiguous = bool(zget(zc, "contiguous_gradients", True))
        self.use_reduce_scatter = bool(zget(zc, "reduce_scatter", True))
        self.allgather_partitions = bool(zget(zc, "allgather_partitions", True))
        self.round_robin = bool(zget(zc, "round_robin_gradients", False))
        self.offload = offload_device(zc, "offload_optimizer") == "cpu"
        self.pin = offload_pin(zc, "offload_optimizer")
        self.clip = float(getattr(cfg, "gradient_clipping", 0.0) or 0.0)
        self.precision = ctx.precision
        self.loss_scaler = ctx.loss_scaler
        self.check_overflow = bool(getattr(ctx.precision, "check_overflow", False))
        check_client_optimizer_for_offload(ctx, self.offload)

        self.group_params = unique_trainable(ctx.param_groups)
        names = {id(p): n for n, p in ctx.module.named_parameters()}
        self.buckets: list[_Bucket] = []
        self.flat_data: list[torch.Tensor | None] = []
        self.flat_grad: list[torch.Tensor | None] = []
        self.masters: list[list[torch.nn.Parameter]] = []  # per group: one flat chunk per bucket
        self.pairs: list[tuple[torch.nn.Parameter, GroupLayout]] = []
        self.master_grads: list[torch.Tensor] = []  # fp32 gradient partitions (buffers or chunk views)
        self._separate_masters: list[torch.Tensor] = []
        self._param_bucket: dict[int, tuple[_Bucket, int]] = {}
        for gi, params in enumerate(self.group_params):
            self._build_group(gi, params, names)
        self._optimizer = build_optimizer(ctx, self.masters, self.group_params)
        if self._optimizer is not None:
            self._optimizer.zero_grad = self._zero_grad_from_optimizer  # type: ignore[method-assign]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_ready)
            for params in self.group_params
            for p in params
            if self.partition_gradients or self.overlap
        ]
        self._param_handles: dict[int, tuple[list[Handle], torch.Tensor]] = {}
        self._pool: dict[int, list[torch.Tensor]] = {}  # padded size -> free staging buffers
        self._module_buckets: dict[torch.nn.Module, list[int]] = {}
        for mod in ctx.module.modules():
            idx = sorted({self._param_bucket[id(p)][0].index for p in mod.parameters(recurse=False) if id(p) in self._param_bucket})
            if idx:
                self._module_buckets[mod] = idx
                self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
        self._launching = False
        self._next_launch = 0
        self._timers = active_timers()
        self._t_bucket = 0.0  # seconds copying into staging buffers this backward (wall_clock_breakdown)
        self._inflight: list[_Bucket] = []
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
        buckets = [_Bucket(len(self.buckets) + i, gi, ps, self.world) for i, ps in enumerate(groups)]
        total = sum(b.padded for b in buckets)
        flat = torch.zeros(total, dtype=dtype, device=device)
        grad = torch.zeros(total, dtype=dtype, device=device) if (self.contiguous and not self.partition_gradients) else None
        # fp32 without offload: the optimizer steps this rank's chunk of the parameter buffer in place
        # (and, in stage 1, reads its gradient from this rank's chunk of the gradient buffer): no copies.
        shared_master = dtype == torch.float32 and not self.offload
        shared_grad = shared_master and grad is not None
        part_numel = sum(b.chunk for b in buckets)
        master = None if shared_master else (
            host_tensor(part_numel, torch.float32, self.pin)
            if self.offload
            else torch.zeros(part_numel, dtype=torch.float32, device=device)
        )
        mgrad = None if shared_grad else (
            host_tensor(part_numel, torch.float32, self.pin)
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
                own = slice(self.rank * b.chunk, (self.rank + 1) * b.chunk)
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
                start += b.padded
                poff += b.chunk
        self.buckets.extend(buckets)
        self.flat_data.append(flat)
        self.flat_grad.append(grad)

    # ------------------------------------------------------------------ contract
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def _zero_grad_from_optimizer(self, set_to_none: bool = True) -> None:
        self.zero_grad()

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
        self._timers = timers = active_timers()
        self._t_bucket = 0.0
        self._wait_params()
        reduce_now = sync and (self.partition_gradients or boundary)
        self._launching = reduce_now and self.overlap
        self._next_launch = 0
        for b in self.buckets:
            b.ready = 0
            b.launched = False
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._launching = False
        if reduce_now:
            t0 = time.perf_counter()
            self._flush()
            if timers is not None:
                timers.add("backward.reduce_wait", time.perf_counter() - t0)
        if timers is not None:
            timers.add("backward.bucket", self._t_bucket)

    def _grad_ready(self, p: torch.Tensor) -> None:
        b, k = self._param_bucket[id(p)]
        if self.partition_gradients and self.contiguous:
            t0 = time.perf_counter() if self._timers is not None else 0.0
            if b.staging is None:
                b.staging = self._acquire(b)
            assert p.grad is not None
            b.staging[b.offsets[k] : b.offsets[k] + b.numels[k]].copy_(p.grad.reshape(-1))
            b.got[k] = True
            p.grad = None
            if self._timers is not None:
                self._t_bucket += time.perf_counter() - t0
        b.ready += 1
        if self._launching and b.ready >= b.expected:
            while self._next_launch < len(self.buckets):
                nb = self.buckets[self._next_launch]
                if nb.ready < nb.expected:
                    break
                self._launch(nb)
                self._next_launch += 1

    def _bucket_input(self, b: _Bucket) -> torch.Tensor:
        if b.grad is not None:
            return b.grad
        if b.staging is None:
            b.staging = self._acquire(b)
        if not (self.partition_gradients and self.contiguous):
            for k, (p, off, n) in enumerate(zip(b.params, b.offsets, b.numels)):
                if p.grad is not None:
                    b.staging[off : off + n].copy_(p.grad.reshape(-1))
                    b.got[k] = True
                    if self.partition_gradients:
                        p.grad = None
        if b.ready < b.expected or not all(b.got):  # parameters without a gradient contribute zeros
            for k, (off, n) in enumerate(zip(b.offsets, b.numels)):
                if not b.got[k]:
                    b.staging[off : off + n].zero_()
        return b.staging

    def _acquire(self, b: _Bucket) -> torch.Tensor:
        """A staging buffer of ``b.padded`` elements from the pool (padding zeroed, rest undefined)."""
        pool = self._pool.get(b.padded)
        buf = pool.pop() if pool else torch.empty(b.padded, dtype=b.data.dtype, device=b.data.device)
        end = b.offsets[-1] + b.numels[-1]
        if end < b.padded:
            buf[end:].zero_()
        b.got = [False] * len(b.params)
        return buf

    def _recycle(self, b: _Bucket) -> None:
        if b.staging is not None:
            pool = self._pool.setdefault(b.padded, [])
            if len(pool) < _MAX_INFLIGHT:
                pool.append(b.staging)
            b.staging = None

    def _launch(self, b: _Bucket) -> None:
        while len(self._inflight) >= _MAX_INFLIGHT:
            self._finish(self._inflight.pop(0))
        inp = self._bucket_input(b)
        if self.world > 1 and self.precision.compute_dtype == torch.float16:
            inp.div_(self.world)  # fp16: average before summing so the sum cannot overflow
        aliased = b.master_grad.data_ptr() == inp[self.rank * b.chunk :].data_ptr()
        direct = (
            (not self.partition_gradients or self._fresh)
            and b.master_grad.dtype == inp.dtype
            and b.master_grad.device == inp.device
            and (not aliased or self.coll.gloo_fast)
        )
        if self.use_reduce_scatter:
            out = b.master_grad if direct else torch.empty(b.chunk, dtype=inp.dtype, device=inp.device)
            b.handle = self.coll.reduce_scatter(out, inp, async_op=True)
            b.out = None if direct else out
        else:
            b.handle = self.coll.all_reduce(inp, async_op=True)
            b.out = inp[self.rank * b.chunk : (self.rank + 1) * b.chunk]
        b.launched = True
        self._inflight.append(b)

    def _finish(self, b: _Bucket) -> None:
        assert b.handle is not None
        b.handle.wait()
        b.handle = None
        if b.out is not None and b.out.data_ptr() != b.master_grad.data_ptr():
            if self._fresh or not self.partition_gradients:
                b.master_grad.copy_(b.out)
            else:
                b.master_grad.add_(b.out)
        b.out = None
        if self.partition_gradients:
            self._recycle(b)

    def _flush(self) -> None:
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        while self._inflight:
            self._finish(self._inflight.pop(0))
        self._fresh = False
        self._reduced = True

    def step(self) -> StepOutcome:
        """Unscale, check overflow, clip by the global norm, step the partitions, all-gather, zero."""
        if not self.partition_gradients and not self._reduced:
            for b in self.buckets:
                b.launched = False
            self._flush()
        if self._fresh:  # nothing was reduced in this window
            for g in self.master_grads:
                g.zero_()
        scale = float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0
        divisor = scale * (1.0 if self.precision.compute_dtype == torch.float16 else float(self.world))
        timers = active_timers()
        t0 = time.perf_counter()
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
            self._all_gather_params(defer=self.overlap)
            if timers is not None:
                timers.add("step.optimizer", t2 - t1)
                timers.add("step.allgather", time.perf_counter() - t2)
        if timers is not None:
            timers.add("step.clip", t1 - t0)
        self.zero_grad()
        return StepOutcome(applied=True, overflow=False, global_grad_norm=norm)  # type: ignore[arg-type]

    @torch.no_grad()
    def _all_gather_params(self, *, defer: bool = False) -> None:
        """Write every rank's updated chunks into the flat parameter buffers.

        Launched in forward order (last bucket first). With ``defer`` (after a step under
        ``overlap_comm``) nothing is waited on here: each module's forward pre-hook waits for the
        buckets holding its parameters, so the gather overlaps the next forward.
        """
        self._wait_params()
        for b in reversed(self.buckets):
            src = b.master
            if src.dtype != b.data.dtype or src.device != b.data.device:
                src = src.to(device=b.data.device, dtype=b.data.dtype, non_blocking=True)
            handles: list[Handle] = []
            if self.world == 1:
                b.data.copy_(src)
            elif not self.allgather_partitions:
                b.data[self.rank * b.chunk : (self.rank + 1) * b.chunk].copy_(src)
                for q in range(self.world):
                    handles.append(self.coll.broadcast(b.data[q * b.chunk : (q + 1) * b.chunk], q, async_op=True))
            elif b.padded <= self.allgather_bucket:
                if not self.coll.gloo_fast and src.data_ptr() == b.data[self.rank * b.chunk :].data_ptr():
                    src = src.clone()  # collectives may not read and write the same memory
                handles.append(self.coll.all_gather(b.data, src, async_op=True))
            else:
                piece = max(1, self.allgather_bucket // self.world)
                for a in range(0, b.chunk, piece):
                    e = min(b.chunk, a + piece)
                    outs = [b.data[q * b.chunk + a : q * b.chunk + e] for q in range(self.world)]
                    handles.append(self.coll.all_gather_list(outs, src[a:e], async_op=True))
            if handles:
                self._param_handles[b.index] = (handles, src)
        if not defer:
            self._wait_params()

    def _wait_params(self, indices: Any = None) -> None:
        if not self._param_handles:
            return
        for i in list(self._param_handles) if indices is None else indices:
            entry = self._param_handles.pop(i, None)
            if entry is not None:
                for h in entry[0]:
                    h.wait()

    def _pre_forward(self, mod: torch.nn.Module, args: Any) -> None:
        if self._param_handles:
            timers = active_timers()
            t0 = time.perf_counter()
            self._wait_params(self._module_buckets[mod])
            if timers is not None:
                timers.add("forward.allgather_wait", time.perf_counter() - t0)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (flat buffers zeroed in place; staging and per-parameter grads freed)."""
        while self._inflight:
            self._finish(self._inflight.pop(0))
        grads = [g for g in self.flat_grad if g is not None]
        if grads:
            torch._foreach_zero_(grads)
        if not self.contiguous or self.partition_gradients:
            for params in self.group_params:
                for p in params:
                    p.grad = None
        for b in self.buckets:
            self._recycle(b)
            b.launched = False
        self._fresh = True
        self._reduced = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed by parameter name (collective: call on every rank)."""
        self._wait_params()
        state, groups, fp32 = optimizer_state_dict(self._optimizer, self.pairs, self.coll)
        out: dict[str, Any] = {
            "param_names": [n for _, lay in self.pairs for n in lay.names],
            "state": state,
            "param_groups": groups,
            "fp32_params": fp32,
        }
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Re-partition a state saved at any world size; refresh module weights from the fp32 masters."""
        self._wait_params()
        fp32 = state.get("fp32_params") if load_optimizer_states else None
        if fp32:
            for m, lay in self.pairs:
                scatter_by_name(fp32, lay, self.rank, m.data)
            self._all_gather_params()
        else:
            self._refresh_masters()
        if not load_optimizer_states:
            return
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self._optimizer is not None:
            load_optimizer_state(self._optimizer, self.pairs, state, self.rank)

    def _refresh_masters(self) -> None:
        with torch.no_grad():
            for b in self.buckets:
                own = b.data[self.rank * b.chunk : (self.rank + 1) * b.chunk]
                if own.data_ptr() != b.master.data_ptr():
                    b.master.copy_(own)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's own state dict (stages 1/2 hold full parameters)."""
        self._wait_params()
        return self.ctx.module.state_dict()

    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights in place (the flat buffers stay) and refresh the fp32 master partitions."""
        self._wait_params()
        self.ctx.module.load_state_dict(state, strict=strict)
        self._refresh_masters()

    def _aliases_flat_grad(self, g: torch.Tensor) -> bool:
        return any(
            f is not None and f.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() for f in self.flat_grad
        )

    def partition_bytes(self) -> dict[str, int]:
        """Bytes on this rank: optimizer state + fp32 masters, module parameters, gradients."""
        opt_bytes = 0
        if self._optimizer is not None:
            for s in self._optimizer.state.values():
                opt_bytes += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
        masters = sum(m.numel() * 4 for m in self._separate_masters)
        params = sum(f.numel() * f.element_size() for f in self.flat_data if f is not None)
        grads = sum(g.numel() * g.element_size() for g in self.flat_grad if g is not None)
        grads += sum(g.numel() * g.element_size() for g in self.master_grads if g.grad_fn is None and not self._aliases_flat_grad(g))
        return {"optimizer_state": opt_bytes + masters, "parameters": params, "gradients": grads}
