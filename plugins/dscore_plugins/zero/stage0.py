"""ZeRO stage 0: plain data parallelism (every rank holds all parameters, gradients and optimizer state).

What DeepSpeed does without ZeRO (``DeepSpeedEngine.allreduce_gradients`` + ``clip_fp32_gradients`` for
fp32, ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` for fp16 and bf16), restated for one code path:

* **Gradients live in flat buffers.** At construction every trainable parameter's ``.grad`` is made a view
  into one contiguous buffer per (device, dtype). Autograd accumulates into those views in place, so a
  gradient accumulation window needs no copies, and the boundary reduction is one all-reduce per bucket
  of ``zero_optimization.reduce_bucket_size`` elements instead of one per parameter. The buffers are
  zeroed (never set to ``None``) after each step; ``engine.zero_grad()`` sets ``.grad`` to None as DeepSpeed
  does, and the views are re-attached at the next ``backward``. Consequence: a parameter that got no gradient in a
  window has a zero ``.grad`` (not ``None``), so optimizers with weight decay or momentum still update it,
  as under ``torch.nn.parallel.DistributedDataParallel(gradient_as_bucket_view=True)``.
* **Reduction** at the boundary: sum all-reduce over the data-parallel group, divided by its size
  (``gradient_allreduce_op: "mean"``; ``"sum"`` skips the division): by the world size before the sum;
  with ``prescale_gradients`` also by the world size before; with ``gradient_predivide_factor`` f != 1 by
  f before and world/f after, as DeepSpeed's engine does
  (:func:`dscore.zero.reducer.gradient_divisors`). ``communication_data_type`` sets the dtype of the
  all-reduce (each bucket converted, reduced and copied back). Nothing is communicated inside
  ``engine.no_sync()`` or with one rank.
* **Step**: unscale by the loss scale, check for inf/NaN (fp16 always, bf16 when
  ``check_grad_overflow``), ask the loss scaler whether to skip, clip to ``gradient_clipping`` by the
  global L2 norm (identical on every rank after the all-reduce, so no extra collective), step the
  optimizer, zero the buffers. Unscaling and clipping are one multiply of each flat buffer.
  The clip coefficient is ``clip / (norm + 1e-6)`` capped at 1, exactly
  :func:`torch.nn.utils.clip_grad_norm_`.
* **Master weights** (fp16/bf16): the module's low-precision parameters are re-pointed into one flat
  buffer, an fp32 copy of it is what the optimizer updates (``engine.optimizer`` is built over the fp32
  master parameters, or a client optimizer's groups are switched to them, like DeepSpeed's
  ``FP16_Optimizer``), and after each applied step the fp32 buffer is copied back in one op.

Reduction runs on the shared :class:`dscore.zero.reducer.GradientReducer`: each bucket owns its slice of
the flat buffer (no copy); under ``overlap_comm`` the hooks launch it as it fills, otherwise adjacent
buckets go out together at the boundary in pieces of ``reduce_bucket_size`` elements.

Hot path: no Python loop over parameters per step; one device sync per boundary only when an overflow
check is required (fp16 / bf16 with ``check_grad_overflow``). The global norm is kept as a 0-dim
tensor (:attr:`StepOutcome.global_grad_norm`) so the engine reads it only on request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from dscore.errors import ConfigError, FragmentAccessError
from dscore.moe.checkpoint import ExpertNaming
from dscore.moe.groups import expert_groups
from dscore.moe.utils import is_moe_param
from dscore.protocols.zero import ParamFragment, StepOutcome, ZeroStage, ZeroStageContext
from dscore.runtime.timers import active_timers, clock
from dscore.zero.optimizer import collective_device, optimizer_state_bytes, unique_trainable
from dscore.zero.reducer import GradientReducer, ReduceBucket, comm_dtype_of, gradient_divisors
from dscore_plugins.zero.config import ZeroConfig

__all__ = ["Stage0", "NoOpOptimizer"]

log = logging.getLogger("dscore.zero.stage0")


class NoOpOptimizer(torch.optim.Optimizer):
    """Holds parameter groups (with ``lr``) but never changes parameters.

    Used for bf16 without an optimizer, where DeepSpeed returns a wrapper around its ``DummyOptim`` so
    that ``engine.optimizer`` is not None.
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D401 - torch signature
        return closure() if closure is not None else None


@torch.no_grad()
def _write_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Copy a full value into the module parameter (a view of the stage's flat buffer when master weights)."""
    param.data.copy_(value.reshape(param.shape))


class _FlatGroup:
    """One contiguous buffer holding the gradients of all parameters of one (device, dtype).

    Attributes:
        params: the parameters, in buffer order.
        grad: 1-D tensor, dtype/device of the parameters, length = total numel; ``p.grad`` are views of it.
        data: 1-D tensor holding the parameters themselves (only with master weights), else None.
        master: 1-D fp32 copy of ``data`` (only with master weights), else None.
        master_grad: 1-D fp32 gradient of ``master`` (only with master weights), else None.
        master_params: fp32 leaf tensors that are views of ``master``, one per parameter.
    """

    def __init__(self, params: list[torch.nn.Parameter], *, master_weights: bool) -> None:
        self.params = params
        first = params[0]
        numel = sum(p.numel() for p in params)
        self.grad = torch.zeros(numel, dtype=first.dtype, device=first.device)
        self.data: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.master_grad: torch.Tensor | None = None
        self.master_params: list[torch.Tensor] = []
        if master_weights:
            self.data = torch.empty(numel, dtype=first.dtype, device=first.device)
        offset = 0
        for p in params:
            n = p.numel()
            if self.data is not None:
                self.data[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self.data[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n
        if master_weights:
            assert self.data is not None
            self.master = self.data.detach().to(torch.float32)
            self.master_grad = torch.zeros_like(self.master)
            offset = 0
            for p in params:
                n = p.numel()
                mp = torch.nn.Parameter(self.master[offset : offset + n].view_as(p))
                mp.grad = self.master_grad[offset : offset + n].view_as(p)
                self.master_params.append(mp)
                offset += n

    def reduce_target(self) -> torch.Tensor:
        """The buffer the optimizer's gradients live in (fp32 master gradient or the module gradient)."""
        return self.master_grad if self.master_grad is not None else self.grad


class Stage0(ZeroStage):
    """Plain data parallelism with flat gradient buffers, optional fp32 master weights, loss scaling.

    Args:
        ctx: see :class:`dscore.protocols.ZeroStageContext`. Reads ``config.gradient_clipping``,
            ``config.gradient_allreduce_op``, ``config.gradient_predivide_factor``,
            ``config.prescale_gradients`` and ``zero_optimization.reduce_bucket_size`` (elements).

    Raises:
        ConfigError: a parameter appears in two groups, or an optimizer was given together with
            parameters it does not hold.
    """

    stage = 0
    supports_grad_norm_sq = True

    def __init__(self, ctx: ZeroStageContext[ZeroConfig]) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.precision = ctx.precision
        self.loss_scaler = ctx.loss_scaler
        self.clip = float(cfg.gradient_clipping)
        self.check_overflow = bool(ctx.precision.check_overflow)
        self._divisor_pair = gradient_divisors(
            op=cfg.gradient_allreduce_op, prescale=bool(cfg.prescale_gradients),
            predivide=float(cfg.gradient_predivide_factor), world=ctx.comm.world_size,
            default=(float(ctx.comm.world_size), 1.0),
        )
        self.bucket_numel = ctx.section.elements("reduce_bucket_size")
        self.world_size = ctx.comm.world_size
        self.master_weights = ctx.precision.compute_dtype in (torch.float16, torch.bfloat16)

        params = [p for ps in unique_trainable(ctx.param_groups, keep_frozen=True) for p in ps]
        # expert parameters (dscore.moe) get flat buffers of their own, reduced over their expert-data-parallel group
        by_key: dict[tuple[torch.device, torch.dtype, str], list[torch.nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype, p.group_name if is_moe_param(p) else ""), []).append(p)
        self.groups = [_FlatGroup(ps, master_weights=self.master_weights) for ps in by_key.values()]
        expert_names = [key[2] for key in by_key]
        self._reduced = False
        self._overlapped = False
        self.overlap = bool(ctx.section.overlap_comm)

        def reducer(comm: Any, groups: list[_FlatGroup]) -> GradientReducer:
            return GradientReducer(comm, self._build_buckets(groups), reduce_scatter=False, ordered=True,
                                   max_inflight=0, max_message=self.bucket_numel,
                                   comm_dtype=comm_dtype_of(cfg.communication_data_type))  # fmt: skip

        self.reducer = reducer(ctx.comm, [g for g, n in zip(self.groups, expert_names) if not n])
        # per expert group name: (reducer over the EDP group, the EP group's comm, its flat groups); the
        # divisor stays the full data-parallel world size, as DeepSpeed's _reduce_expert_gradients
        self._experts: list[tuple[GradientReducer, Any, list[_FlatGroup]]] = []
        for name in sorted({n for n in expert_names if n}):
            eg = expert_groups(ctx.comm, int(name.rsplit("_", 1)[1]), mesh=getattr(ctx.runtime, "mesh", None))
            groups = [g for g, n in zip(self.groups, expert_names) if n == name]
            self._experts.append((reducer(eg.edp_comm, groups), eg.ep_comm, groups))
        self._reducers = [self.reducer] + [r for r, _, _ in self._experts]
        self._hooks = (
            [h for r in self._reducers for h in r.register_hooks()] if self.overlap and self.world_size > 1 else []
        )

        # Map module parameter -> the tensor the optimizer updates.
        target: dict[int, torch.Tensor] = {}
        for g in self.groups:
            for p, mp in zip(g.params, g.master_params or g.params):
                target[id(p)] = mp
        self._optimizer = self._build_optimizer(target)
        self._target = target
        self._flat_index: dict[int, tuple[_FlatGroup, int]] | None = None  # built by param_fragment
        self._flat_optimizer_grads = [g.reduce_target() for g in self.groups]
        log.debug(
            "stage 0: %d parameter(s) in %d flat buffer(s), master weights=%s, world=%d",
            len(params),
            len(self.groups),
            self.master_weights,
            self.world_size,
        )

    # ------------------------------------------------------------------ construction helpers
    def _build_buckets(self, groups: list[_FlatGroup]) -> list[ReduceBucket]:
        """Cut each flat gradient buffer into reduce buckets of about ``bucket_numel`` elements along
        parameter boundaries, walking the parameters in reverse (the order backward produces them), so
        the last bucket of the buffer fills first. Each bucket owns its slice of the buffer (the
        ``.grad`` views), so reducing it copies nothing; the reducer launches them in list order."""
        buckets: list[ReduceBucket] = []
        for g in groups:
            offsets = []
            off = 0
            for p in g.params:
                offsets.append(off)
                off += p.numel()
            end = lo = off  # the open bucket is [lo, end), holding params[idx]
            idx: list[int] = []
            for i in range(len(g.params) - 1, -1, -1):
                start = offsets[i]
                if end > lo and end - start > self.bucket_numel:
                    buckets.append(ReduceBucket([g.params[k] for k in reversed(idx)], grad=g.grad[lo:end]))
                    end, idx = lo, []
                lo = start
                idx.append(i)
            if end > lo:
                buckets.append(ReduceBucket([g.params[k] for k in reversed(idx)], grad=g.grad[lo:end]))
        return buckets

    def _build_optimizer(self, target: dict[int, torch.Tensor]) -> torch.optim.Optimizer | None:
        ctx = self.ctx
        # Group i of the optimizer is group i of ctx.param_groups (empty and all-frozen groups kept), so
        # each group's hyper-parameters apply to exactly its parameters and per-group scheduler lists line up.
        if ctx.client_optimizer is not None:
            opt = ctx.client_optimizer
            for gi, group in enumerate(opt.param_groups):
                missing = [i for i, p in enumerate(group["params"]) if p.requires_grad and id(p) not in target]
                if missing:
                    raise ConfigError(
                        f"the client optimizer's param_groups[{gi}] holds parameters (positions {missing[:5]}) that "
                        "are not trainable parameters given to the engine; build it over model.parameters() or "
                        "pass model_parameters matching it"
                    )
                # frozen parameters never get a gradient here: leave them out of the stepped groups
                group["params"] = [target[id(p)] for p in group["params"] if p.requires_grad]
            if self.master_weights and opt.state:
                opt.state = type(opt.state)({target.get(id(k), k): v for k, v in opt.state.items()})
        elif ctx.optimizer_factory is not None:
            groups = [{**g, "params": [target[id(p)] for p in g["params"]]} for g in ctx.param_groups]
            opt = ctx.optimizer_factory(groups)
        elif self.precision.name == "bf16" and self.master_weights:
            opt = NoOpOptimizer([target[id(p)] for g in ctx.param_groups for p in g["params"]])
        else:
            return None
        # Zeroing through the optimizer must keep the flat buffers (and the views) alive.
        opt.zero_grad = self._zero_grad_from_optimizer  # type: ignore[method-assign]
        return opt

    def _zero_grad_from_optimizer(self, set_to_none: bool = True) -> None:
        self._zero_buffers()  # keeps the .grad views: a direct loss.backward() may follow (engine.zero_grad() frees them)

    def _attach_grads(self) -> None:
        self._grads_detached = False
        for g in self.groups:
            offset = 0
            for p in g.params:
                n = p.numel()
                p.grad = g.grad[offset : offset + n].view_as(p)
                offset += n

    # ------------------------------------------------------------------ contract
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        """``loss.backward()`` into the flat buffers; at a synced boundary all-reduce them (averaged).

        Under ``overlap_comm`` (and more than one rank) each bucket's all-reduce is launched
        asynchronously from the gradient hooks as soon as all its parameters have their gradient, in
        bucket order, so communication overlaps the rest of backward (what DDP's reducer does); the
        remaining buckets are launched and everything is waited for once autograd is done.
        """
        if getattr(self, "_grads_detached", False):
            self._attach_grads()  # after zero_grad() (which leaves .grad None), before autograd writes them
        launch = bool(self._hooks) and boundary and sync and not self._local_gradients()
        if launch:
            for r in self._reducers:
                r.begin(launch=True, prescale=self._divisors()[0], timed=active_timers() is not None)
            self._overlapped = True
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            for r in self._reducers:
                r.end()
        if boundary and sync:
            self._reduce()

    def _divisors(self) -> tuple[float, float]:
        return self._divisor_pair

    def _local_gradients(self) -> bool:
        """True when the optimizer communicates itself and wants this rank's own gradients (1-bit Adam/Lamb
        after their warm-up: ``gradient_allreduce_needed`` is False), as DeepSpeed's engine disables its
        backward all-reduce for them."""
        return getattr(self._optimizer, "gradient_allreduce_needed", True) is False

    def _reduce(self) -> None:
        self._reduced = True
        overlapped, self._overlapped = self._overlapped, False
        if not overlapped and (self.world_size == 1 or self._local_gradients()):
            return
        timers = active_timers()
        pre, post = self._divisors()
        if not overlapped:
            for r in self._reducers:
                r.begin(launch=False, prescale=pre, timed=timers is not None)
        t0 = clock(timers)
        for r in self._reducers:
            r.flush()  # launches what backward did not (all of it without overlap), then waits
        t1 = clock(timers)
        if post != 1.0:
            torch._foreach_div_([g.grad for g in self.groups], post)
        if timers is not None:
            timers.add("backward.reduce_launch", sum(r.launch_seconds for r in self._reducers))
            timers.add("backward.reduce_wait", t1 - t0)

    def step(self) -> StepOutcome:
        """Unscale, check overflow, clip, step, zero. See the module docstring for the exact order."""
        if not self._reduced:
            self._reduce()
        self._reduced = False
        timers = active_timers()
        t_clip = clock(timers)
        scale = float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0
        if self.master_weights:
            for g in self.groups:
                assert g.master_grad is not None
                g.master_grad.copy_(g.grad)
        flats = self._flat_optimizer_grads
        need_norm = self.clip > 0.0 or self.check_overflow
        norm: torch.Tensor | None = None
        if need_norm and self.grad_norm_sq is not None:
            # the whole model's norm (AutoTP): one collective every rank enters, so every rank decides alike
            norm = self.grad_norm_sq(collective_device(flats)).to(torch.float32).sqrt()
        elif need_norm and flats:
            norms = [torch.linalg.vector_norm(f, dtype=torch.float32) for f in flats]
            if self._experts:
                norm = self._norm_with_experts(norms)
            else:
                norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        overflow = False
        if self.check_overflow and norm is not None:
            if self.world_size > 1 and self._local_gradients():
                # gradients were not all-reduced, so an inf on one rank is not seen by the others: agree first
                flag = (~torch.isfinite(norm)).to(torch.float32).reshape(1)
                self.ctx.comm.all_reduce(flag, op="max")
                overflow = bool(flag.item())
            else:
                overflow = not bool(torch.isfinite(norm))  # the one device sync of a checked step
        skip = self.loss_scaler.update(overflow) if self.loss_scaler is not None else overflow
        if skip or overflow:
            self._zero_buffers()
            return StepOutcome(applied=False, overflow=overflow, global_grad_norm=None)
        if norm is not None and scale != 1.0:
            norm = norm / scale
        if flats:
            if self.clip > 0.0:
                assert norm is not None
                coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
                if scale != 1.0:
                    coef = coef / scale
                torch._foreach_mul_(flats, coef) if len(flats) > 1 else flats[0].mul_(coef)
            elif scale != 1.0:
                torch._foreach_mul_(flats, 1.0 / scale)
        t0 = clock(timers)
        if self._optimizer is not None:
            self._optimizer.step()
        if self.master_weights:
            for g in self.groups:
                assert g.data is not None and g.master is not None
                g.data.copy_(g.master)
        self._zero_buffers()
        if timers is not None:
            timers.add("step.clip", t0 - t_clip)
            timers.add("step.optimizer", clock(timers) - t0)
        return StepOutcome(applied=True, overflow=False, global_grad_norm=norm)

    def _norm_with_experts(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm when expert gradients differ across the expert-parallel group: the squared norms
        of each expert group's buffers are summed over its EP group (every expert counted once)."""
        expert_ids = {id(g): k for k, (_, _, groups) in enumerate(self._experts) for g in groups}
        shared = torch.zeros((), dtype=torch.float32, device=norms[0].device)
        per_expert = [torch.zeros(1, dtype=torch.float32, device=norms[0].device) for _ in self._experts]
        for g, n in zip(self.groups, norms):
            k = expert_ids.get(id(g))
            if k is None:
                shared = shared + n.float() ** 2
            else:
                per_expert[k] += n.float() ** 2
        total = shared
        for (_, ep_comm, _), sq in zip(self._experts, per_expert):
            ep_comm.all_reduce(sq, op="sum")
            total = total + sq[0]
        return torch.sqrt(total)

    def zero_grad(self) -> None:
        """Drop the gradients: ``.grad`` of every module parameter is None afterwards (DeepSpeed's
        ``engine.zero_grad()``); the zeroed flat buffers are re-attached as views at the next ``backward``."""
        self._zero_buffers()
        for g in self.groups:
            for p in g.params:
                p.grad = None
        self._grads_detached = True

    def _zero_buffers(self) -> None:
        # after a step: zero in place, the ``.grad`` views stay attached (no per-parameter work per step)
        self._reduced = False
        bufs = [g.grad for g in self.groups] + [g.master_grad for g in self.groups if g.master_grad is not None]
        if bufs:
            torch._foreach_zero_(bufs)

    def param_fragment(self, param: torch.nn.Parameter) -> ParamFragment | None:
        """The whole parameter (nothing is partitioned at stage 0): its fp32 master slice (the parameter
        itself under fp32), its averaged gradient from the boundary's ``backward`` until ``step``, and the
        optimizer state of the tensor the optimizer steps for it.

        Raises:
            FragmentAccessError: ``param`` is not a parameter of the engine's module.
        """
        if self._flat_index is None:
            index: dict[int, tuple[_FlatGroup, int]] = {}
            for g in self.groups:
                off = 0
                for p in g.params:
                    index[id(p)] = (g, off)
                    off += p.numel()
            self._flat_index = index
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        hit = self._flat_index.get(id(param))
        if hit is None or not param.requires_grad:
            if id(param) in names:
                return None  # frozen: no master, gradient or optimizer state
            raise FragmentAccessError(
                f"the tensor (shape {tuple(param.shape)}) is not a parameter of this engine's module; pass one of "
                "engine.module.parameters()"
            )
        g, off = hit
        n = param.numel()
        master = g.master[off : off + n] if g.master is not None else param.data.view(-1)
        return ParamFragment(
            name=names.get(id(param), f"param_{id(param)}"), shape=param.shape, start=0, numel=n, master=master,
            optimizer=self._optimizer, optimizer_param=self._target.get(id(param)) if self._optimizer else None,
            state_offset=0, grad=g.grad[off : off + n] if self._reduced else None, grad_divisor=1.0,  # _reduce divided
            comm=None, device=param.device, write_weights=lambda value: _write_param(param, value),
        )

    # ------------------------------------------------------------------ checkpoints
    def _named(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        for g in self.groups:
            for p in g.params:
                yield names.get(id(p), f"param_{id(p)}"), p

    def _opt_param_names(self) -> dict[int, str]:
        """id(tensor the optimizer updates) -> module parameter name."""
        out: dict[int, str] = {}
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        for g in self.groups:
            for p, mp in zip(g.params, g.master_params or g.params):
                out[id(mp)] = names.get(id(p), f"param_{id(p)}")
        return out

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (see :meth:`ZeroStage.state_dict`); MoE experts under
        their global names, gathered over the expert-parallel group (:mod:`dscore.moe.checkpoint`)."""
        out = self._local_state_dict()
        naming = ExpertNaming(self.ctx.module)
        if naming:
            out["param_names"] = naming.globalize_names(out["param_names"])
            out["state"] = naming.globalize(out["state"])
            for group in out["param_groups"]:
                group["param_names"] = naming.globalize_names(group["param_names"])
            if "fp32_params" in out:
                out["fp32_params"] = naming.globalize(out["fp32_params"])
        return out

    def _local_state_dict(self) -> dict[str, Any]:
        names = self._opt_param_names()
        out: dict[str, Any] = {"param_names": [n for n, _ in self._named()], "state": {}, "param_groups": []}
        if self._optimizer is not None:
            for group in self._optimizer.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                hyper["param_names"] = [names[id(p)] for p in group["params"]]
                out["param_groups"].append(hyper)
                for p in group["params"]:
                    state = self._optimizer.state.get(p)
                    if state:
                        out["state"][names[id(p)]] = {
                            k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()
                        }
        if self.master_weights:
            out["fp32_params"] = {names[id(mp)]: mp.detach().clone() for g in self.groups for mp in g.master_params}
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Restore :meth:`state_dict` output (any world size: stage 0 state is not partitioned).

        Without ``load_optimizer_states`` only the fp32 master weights are refreshed from the module (so
        they match loaded 16-bit weights). Raises ``KeyError`` naming a parameter missing in ``state``.
        """
        naming = ExpertNaming(self.ctx.module)
        if naming:  # keep this rank's experts, under their local names
            state = dict(state)
            state["state"] = naming.localize(state.get("state", {}))
            if state.get("fp32_params"):
                state["fp32_params"] = naming.localize(state["fp32_params"])
        names = self._opt_param_names()
        by_name = {names[id(mp)]: mp for g in self.groups for mp in (g.master_params or g.params)}
        with torch.no_grad():
            if self.master_weights:
                fp32 = state.get("fp32_params") if load_optimizer_states else None
                for g in self.groups:
                    assert g.master is not None and g.data is not None
                    if fp32:
                        for mp in g.master_params:
                            mp.copy_(fp32[names[id(mp)]])
                    else:
                        g.master.copy_(g.data)
        if not load_optimizer_states or self._optimizer is None:
            return
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        saved_groups = state.get("param_groups", [])
        if len(saved_groups) != len(self._optimizer.param_groups):
            raise ConfigError(
                f"checkpoint has {len(saved_groups)} optimizer parameter group(s), the engine has "
                f"{len(self._optimizer.param_groups)}"
            )
        for group, saved in zip(self._optimizer.param_groups, saved_groups):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    group[k] = v
        self._optimizer.state.clear()
        for name, pstate in state.get("state", {}).items():
            p = by_name[name]
            self._optimizer.state[p] = {
                k: (v.to(device=p.device) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in pstate.items()
            }

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's own state dict (stage 0 holds full parameters on every rank); MoE experts under
        their global names, every rank's (collective over the expert-parallel group)."""
        naming = ExpertNaming(self.ctx.module)
        sd = self.ctx.module.state_dict()
        return type(sd)(naming.globalize(dict(sd))) if naming else sd

    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights into the module (in place, keeping the flat buffers) and refresh fp32 masters
        (MoE experts: this rank's, found under their global names)."""
        naming = ExpertNaming(self.ctx.module)
        self.ctx.module.load_state_dict(naming.localize(dict(state)) if naming else state, strict=strict)
        if self.master_weights:
            with torch.no_grad():
                for g in self.groups:
                    assert g.master is not None and g.data is not None
                    g.master.copy_(g.data)

    def partition_bytes(self) -> dict[str, int]:
        opt_bytes = optimizer_state_bytes(self._optimizer)
        params = sum(g.grad.numel() * g.grad.element_size() for g in self.groups)
        masters = sum(g.master.numel() * 4 for g in self.groups if g.master is not None)
        grads = params + sum(g.master_grad.numel() * 4 for g in self.groups if g.master_grad is not None)
        return {"optimizer_state": opt_bytes + masters, "parameters": params, "gradients": grads}

