"""ZeRO stage 2 with a different bucketing policy, built on dscore's public ZeRO building blocks.

What it shares with dscore's built-in stage 2 (and so trains to the same numbers): gradients are
reduce-scattered in buckets during backward by :class:`dscore.zero.GradientReducer`, each rank keeps only
its fp32 chunk of every bucket (gradients, master weights, optimizer state), the step unscales and clips
by the global norm (:func:`dscore.zero.unscale_clip`) and every rank's updated chunks are all-gathered
back into the module's parameters.

What differs: the built-in stage cuts buckets by *size* (``reduce_bucket_size`` elements); this one cuts
them by *count*: every ``example_zero.params_per_bucket`` parameters (in backward order) form a bucket,
whatever their sizes. Checkpoints are world-size independent through :mod:`dscore.zero.layout`.

Only public names are used: ``dscore.protocols``, ``dscore.zero``, ``dscore.errors``.
"""

from __future__ import annotations

from typing import Any

import torch

from dscore.errors import ConfigError
from dscore.protocols import StepOutcome, ZeroStage, ZeroStageContext
from dscore.zero import (
    GradientReducer,
    GroupLayout,
    ReduceBucket,
    Segment,
    build_optimizer,
    load_partitioned_state,
    optimizer_state_bytes,
    partitioned_state_dict,
    unique_trainable,
    unscale_clip_for_step,
)
from dscore_example_zero.config import ExampleZeroConfig

__all__ = ["CountBucketStage2"]


class CountBucket(ReduceBucket):
    """A reduce bucket plus its slice of the parameter buffer and this rank's fp32 master chunk."""

    data: torch.Tensor
    master: torch.Tensor


class CountBucketStage2(ZeroStage):
    """ZeRO-2 with count-based buckets (see the module docstring).

    Args:
        ctx: reads ``ctx.section.overlap_comm`` and ``offload_optimizer``, ``ctx.config.gradient_clipping``
            and the ``example_zero`` section.

    Raises:
        ConfigError: optimizer offload (not implemented by this example), or a parameter in two groups.
    """

    stage = 2

    def __init__(self, ctx: ZeroStageContext) -> None:
        super().__init__(ctx)
        if ctx.section.offload_optimizer is not None and ctx.section.offload_optimizer.device != "none":
            raise ConfigError(
                "zero_optimization.offload_optimizer is not supported by the count_bucket_stage2 example stage; "
                "remove it or use the built-in stage2",
                path="zero_optimization.offload_optimizer",
            )
        own = ctx.config.section("example_zero") or ExampleZeroConfig()
        self.per_bucket = own.params_per_bucket
        self.comm = ctx.comm
        self.world, self.rank = self.comm.world_size, self.comm.rank
        self.clip = float(ctx.config.gradient_clipping)
        self.precision = ctx.precision
        self.loss_scaler = ctx.loss_scaler
        names = {id(p): n for n, p in ctx.module.named_parameters()}

        self.group_params = unique_trainable(ctx.param_groups)
        self.buckets: list[CountBucket] = []
        self.masters: list[list[torch.nn.Parameter]] = []
        self.pairs: list[tuple[torch.nn.Parameter, GroupLayout]] = []
        self.flat: list[torch.Tensor] = []
        for params in self.group_params:
            self.masters.append(self._build_group(params, names) if params else [])
        self._optimizer = build_optimizer(ctx, self.masters, self.group_params)
        self.reducer = GradientReducer(
            self.comm,
            self.buckets,
            reduce_scatter=True,
            copy_on_hook=True,
            free_grads=True,
            ordered=True,
            max_inflight=2,
        )
        self._hooks = self.reducer.register_hooks()
        self._fresh = True

    @torch.no_grad()
    def _build_group(self, params: list[torch.nn.Parameter], names: dict[int, str]) -> list[torch.nn.Parameter]:
        """Buckets of ``per_bucket`` parameters in backward order; the group's parameters become views of
        one flat buffer; this rank's fp32 chunks form one master partition (one optimizer tensor)."""
        order = list(reversed(params))
        buckets = [
            CountBucket(order[i : i + self.per_bucket], pad_to=self.world) for i in range(0, len(order), self.per_bucket)
        ]
        flat = torch.zeros(sum(b.padded for b in buckets), dtype=params[0].dtype, device=params[0].device)
        part = sum(b.chunk for b in buckets)
        master = torch.zeros(part, dtype=torch.float32, device=params[0].device)
        master_grad = torch.zeros_like(master)
        layout = GroupLayout(numel=part)
        start = poff = 0
        for b in buckets:
            b.data = flat[start : start + b.padded]
            for p, off, n in zip(b.params, b.offsets, b.numels):
                b.data[off : off + n].copy_(p.detach().reshape(-1))
                p.data = b.data[off : off + n].view_as(p)
                p.grad = None
            b.master = master[poff : poff + b.chunk]
            b.master.copy_(b.data[self.rank * b.chunk : (self.rank + 1) * b.chunk])
            b.target = master_grad[poff : poff + b.chunk]
            layout.segments.append(
                Segment(
                    part_offset=poff,
                    chunk=b.chunk,
                    names=[names.get(id(p), f"param_{id(p)}") for p in b.params],
                    offsets=list(b.offsets),
                    numels=list(b.numels),
                    shapes=[p.shape for p in b.params],
                )
            )
            start += b.padded
            poff += b.chunk
        self.buckets.extend(buckets)
        self.flat.append(flat)
        mp = torch.nn.Parameter(master)
        mp.grad = master_grad
        self.pairs.append((mp, layout))
        return [mp]

    # ------------------------------------------------------------------ contract
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        """Backward; every bucket is reduce-scattered as it fills (``overlap_comm``) or right after.

        Raises:
            ConfigError: ``sync=False``: partitioned gradients cannot accumulate locally.
        """
        if not sync:
            raise ConfigError("no_sync is incompatible with gradient partitioning (zero_optimization.stage 2)")
        fp16 = self.precision.compute_dtype == torch.float16
        self.reducer.begin(
            launch=bool(self.ctx.section.overlap_comm),
            prescale=float(self.world) if fp16 and self.world > 1 else 1.0,
            accumulate=not self._fresh,
        )
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self.reducer.end()
        self.reducer.flush()
        self._fresh = False

    def step(self) -> StepOutcome:
        """Unscale, clip by the global norm, step the fp32 partitions, all-gather the parameters."""
        grads = [m.grad for ms in self.masters for m in ms if m.grad is not None]
        if self._fresh:
            for g in grads:
                g.zero_()
        norm, skip, overflow = unscale_clip_for_step(
            grads, self.comm, precision=self.precision, loss_scaler=self.loss_scaler, clip=self.clip, world=self.world
        )
        if skip:
            self.zero_grad()
            return StepOutcome(applied=False, overflow=overflow, global_grad_norm=None)
        if self._optimizer is not None:
            self._optimizer.step()
        self._gather_params()
        self.zero_grad()
        return StepOutcome(applied=True, overflow=False, global_grad_norm=norm)

    @torch.no_grad()
    def _gather_params(self) -> None:
        works = [
            self.comm.all_gather_into_tensor(b.data, b.master.to(b.data.dtype), async_op=True) for b in self.buckets
        ]
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        """Drop this window's gradients (in-flight reductions are waited for and discarded)."""
        self.reducer.reset()
        for params in self.group_params:
            for p in params:
                p.grad = None
        self._fresh = True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed by parameter name (collective: call on every rank)."""
        return partitioned_state_dict(self._optimizer, self.pairs, self.comm, self.loss_scaler)

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Re-partition a state saved at any world size (fp32 masters, optimizer state, loss scale)."""
        load_partitioned_state(
            state, opt=self._optimizer, pairs=self.pairs, rank=self.rank, loss_scaler=self.loss_scaler,
            load_optimizer_states=load_optimizer_states,
            masters_loaded=lambda loaded: self._gather_params() if loaded else self._refresh_masters(),
        )

    @torch.no_grad()
    def _refresh_masters(self) -> None:
        for b in self.buckets:
            b.master.copy_(b.data[self.rank * b.chunk : (self.rank + 1) * b.chunk])

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's own state dict (stage 2 holds full parameters)."""
        return self.ctx.module.state_dict()

    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights in place and refresh the fp32 master partitions."""
        self.ctx.module.load_state_dict(state, strict=strict)
        self._refresh_masters()

    def partition_bytes(self) -> dict[str, int]:
        """Bytes on this rank: optimizer state + fp32 masters, parameters, fp32 gradient partitions."""
        opt = optimizer_state_bytes(self._optimizer)
        masters = sum(m.numel() * 4 for ms in self.masters for m in ms)
        params = sum(f.numel() * f.element_size() for f in self.flat)
        return {"optimizer_state": opt + masters, "parameters": params, "gradients": masters}
