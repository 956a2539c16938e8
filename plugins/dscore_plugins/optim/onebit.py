"""1-bit Adam and 1-bit LAMB: error-feedback sign compression of the momentum after a warm-up.

**A dscore addition.** DeepSpeed 0.19.8 removed ``OneBitAdam``/``OneBitLamb`` (selecting them raises
"is not a supported DeepSpeed Optimizer"); dscore keeps them, written from the papers and DeepSpeed
HEAD's documented behaviour (``deepspeed-behaviour.md`` §4):

* 1-bit Adam: Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
  Convergence Speed", arXiv:2102.02888.
* 1-bit LAMB: Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with LAMB's
  Convergence Speed", arXiv:2104.06069.

Two stages, counted in optimizer steps:

1. **Warm-up** (the first ``freeze_step`` steps): exact Adam/LAMB on gradients the engine has already
   averaged across ranks (``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, update
   ``m / (sqrt(v) + eps) (+ weight_decay p)``, no bias correction, as DeepSpeed's OnebitAdam).
2. **Compression** (afterwards): ``v`` is frozen. Each rank folds its *local* gradient into its momentum
   and the momenta are averaged with :func:`compressed_allreduce`: every rank sends ``sign(m + e_w)``
   packed 8 per byte plus one fp32 scale ``||m + e_w||_2 / sqrt(n)`` and keeps the compression residue
   ``e_w`` (worker error feedback); rank ``r`` averages chunk ``r`` of all workers' decompressed momenta,
   compresses that again with its server residue ``e_s``, and every rank gathers the server signs and
   scales. All ranks therefore hold the identical averaged momentum and stay in sync.

Communication: the default ``torch.distributed`` process group (or ``process_group``), with two
``all_gather`` calls per parameter per step (gloo has no all-to-all), moving ``~n/8`` bytes per rank
instead of ``4n``. Without an initialised process group (or with world size 1) the same compression runs
locally. What the engine must do: average gradients across ranks while
:attr:`OneBitAdam.gradient_allreduce_needed` is True (warm-up) and may skip its gradient all-reduce
afterwards (the local gradient is what the compression stage wants; averaged gradients also work, they
only waste communication). Incompatible with ZeRO stages 1-3 (as in DeepSpeed): the momentum must be
complete on every rank.

Differences from DeepSpeed HEAD: per-parameter compression (HEAD's OnebitLamb fuses all momenta into one
buffer after rescaling them), the error buffers are sized to the valid elements (padding to a multiple of
``8 * world_size`` carries no error), ``cuda_aware``/``comm_backend_name`` are accepted and ignored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_plugins.optim.config import OneBitAdamParams, OneBitLambParams

__all__ = [
    "OneBitAdam",
    "OneBitLamb",
    "build_onebit_adam",
    "build_onebit_lamb",
    "compressed_allreduce",
    "pack_signs",
    "unpack_signs",
]

log = logging.getLogger("dscore.optim")

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x >= 0`` of a 1-D tensor whose length is a multiple of 8 into uint8 (bit 7 first).

    Zero counts as positive (DeepSpeed maps 0 to +1 as well).
    """
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a 1-D tensor of ±1 (``8 * packed.numel()`` elements, ``dtype``)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) & weights).ne(0)
    return bits.view(-1).to(dtype).mul_(2).sub_(1)


def _world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def _all_gather(t: torch.Tensor, world: int, group: Any) -> list[torch.Tensor]:
    if world == 1:
        return [t]
    from dscore.comm import active_comm  # the one Comm every collective goes through

    out = [torch.empty_like(t) for _ in range(world)]
    active_comm().all_gather(out, t.contiguous(), group=group)
    return out


def _compress(buf: torch.Tensor, valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale, packed signs and residue of ``buf`` (1-D fp32, length a multiple of 8); only the first
    ``valid`` entries count for the scale and carry a residue."""
    n = max(valid, 1)
    scale = buf[:valid].norm() / math.sqrt(n)
    signs = torch.where(buf >= 0, 1.0, -1.0)
    residue = buf - scale * signs
    residue[valid:] = 0
    return scale.reshape(1), pack_signs(buf), residue


def compressed_allreduce(
    x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Average ``x`` over the ranks of ``group`` with two-stage error-feedback 1-bit compression.

    Args:
        x: any shape, floating point (same shape on every rank).
        worker_error: fp32 1-D buffer of ``padded(x.numel())`` elements, updated in place.
        server_error: fp32 1-D buffer of ``padded(x.numel()) // world_size`` elements, updated in place.
        group: a ``torch.distributed`` process group (None: the default group, or local when none exists).

    Returns:
        a tensor of ``x``'s shape and dtype, identical on every rank.

    ``padded(n)`` is ``n`` rounded up to a multiple of ``8 * world_size``; see :func:`error_buffer_sizes`.
    """
    world, rank = _world(group)
    n = x.numel()
    padded, chunk = error_buffer_sizes(n, world)
    buf = torch.zeros(padded, dtype=torch.float32, device=x.device)
    buf[:n] = x.reshape(-1).float()
    buf.add_(worker_error)
    scale, packed, residue = _compress(buf, n)
    worker_error.copy_(residue)
    scales = _all_gather(scale, world, group)
    signs = _all_gather(packed, world, group)
    # server: chunk `rank` of every worker's decompressed tensor, averaged
    lo, hi = rank * chunk, (rank + 1) * chunk
    server = torch.zeros(chunk, dtype=torch.float32, device=x.device)
    for s, bits in zip(scales, signs):
        server.add_(unpack_signs(bits[lo // 8 : hi // 8]) * s)
    server.div_(world).add_(server_error)
    valid = max(0, min(n, hi) - lo)
    s_scale, s_packed, s_residue = _compress(server, valid)
    server_error.copy_(s_residue)
    all_scales = _all_gather(s_scale, world, group)
    all_signs = _all_gather(s_packed, world, group)
    out = torch.cat([unpack_signs(b) * s for s, b in zip(all_scales, all_signs)])
    return out[:n].view(x.shape).to(x.dtype)


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """``(worker_error_numel, server_error_numel)`` for a tensor of ``numel`` elements."""
    unit = 8 * world_size
    padded = max(unit, -(-numel // unit) * unit)
    return padded, padded // world_size


class _OneBitBase(torch.optim.Optimizer):
    """Shared warm-up/compression bookkeeping of :class:`OneBitAdam` and :class:`OneBitLamb`."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], freeze_step: int, process_group: Any) -> None:
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.process_group = process_group
        self.global_step = 0

    @property
    def gradient_allreduce_needed(self) -> bool:
        """True while the next step is a warm-up step (the engine must average gradients first)."""
        return self.global_step < self.freeze_step

    @property
    def compression_active(self) -> bool:
        """True once the warm-up is over (momenta are 1-bit compressed and averaged by the optimizer)."""
        return self.global_step >= self.freeze_step

    def _errors(self, state: dict[str, Any], p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        world, _ = _world(self.process_group)
        padded, chunk = error_buffer_sizes(p.numel(), world)
        we, se = state.get("worker_error"), state.get("server_error")
        if we is None or we.numel() != padded or se is None or se.numel() != chunk:
            we = state["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=p.device)
            se = state["server_error"] = torch.zeros(chunk, dtype=torch.float32, device=p.device)
        return we, se

    def _compressed_momentum(self, state: dict[str, Any], p: torch.Tensor, m: torch.Tensor) -> None:
        we, se = self._errors(state, p)
        m.copy_(compressed_allreduce(m, we, se, self.process_group))

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["onebit_global_step"] = self.global_step
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.global_step = int(state_dict.pop("onebit_global_step", 0))
        super().load_state_dict(state_dict)

    @staticmethod
    def _denom(v: torch.Tensor, eps: float, inside: bool) -> torch.Tensor:
        return (v + eps).sqrt() if inside else v.sqrt().add_(eps)


class OneBitAdam(_OneBitBase):
    """1-bit Adam (see the module docstring).

    Args:
        params: tensors or param groups.
        lr: learning rate. freeze_step: warm-up steps of exact Adam. betas, eps, eps_inside_sqrt,
            weight_decay: Adam terms (weight decay is added to the update).
        process_group: ``torch.distributed`` group for the compressed all-reduce (None = default group).
        bias_correction, amsgrad, cuda_aware, comm_backend_name: accepted for DeepSpeed compatibility
            (``amsgrad=True`` raises ValueError).

    State per parameter: ``exp_avg``, ``exp_avg_sq`` (parameter shape/dtype), ``worker_error``,
    ``server_error`` (fp32, 1-D) once compression starts.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        process_group: Any = None,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitAdam does not support amsgrad")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay)
        super().__init__(params, defaults, freeze_step, process_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compression_active
        if compress and self.global_step == self.freeze_step:
            log.info("OneBitAdam: warm-up of %d steps done; starting 1-bit compressed momentum", self.freeze_step)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                if compress:
                    self._compressed_momentum(state, p, m)
                else:
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = m / self._denom(v, group["eps"], group["eps_inside_sqrt"])
                if group["weight_decay"] > 0:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        self.global_step += 1
        return loss


class OneBitLamb(_OneBitBase):
    """1-bit LAMB (see the module docstring).

    Warm-up: LAMB without bias correction; the trust ratio ``||p|| / ||u||`` (1 when a norm is 0) is
    clamped to ``[min_coeff, max_coeff]`` and tracked as an EMA ``lamb_coeff_freeze`` (coefficient
    ``coeff_beta``). Compression: ``v`` is frozen; with the compressed averaged momentum ``m`` and the
    previous ``m_prev``, a fresh variance is tracked from the reconstructed gradient
    ``g = (m - b1 m_prev) / (1 - b1)``; the step uses ``lamb_coeff_freeze * factor`` where
    ``factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))`` (mixed with 1 by the share of the
    weight-decay-free update when ``weight_decay > 0``), clamped to ``[factor_min, factor_max]`` and to
    ``±factor_threshold`` relative change from the previous factor.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        process_group: Any = None,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitLamb does not support amsgrad")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, defaults, freeze_step, process_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compression_active
        last_warmup = self.global_step + 1 == self.freeze_step
        for group in self.param_groups:
            b1, b2 = group["betas"]
            eps, inside, wd = group["eps"], group["eps_inside_sqrt"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["lamb_coeff_freeze"] = 0.0
                    state["last_factor"] = 1.0
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if not compress:
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    update = m / self._denom(v, eps, inside)
                    if wd > 0:
                        update.add_(p, alpha=wd)
                    w_norm, u_norm = float(p.float().norm()), float(update.float().norm())
                    coeff = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                    coeff = min(max(coeff, group["min_coeff"]), group["max_coeff"])
                    cb = group["coeff_beta"]
                    state["lamb_coeff_freeze"] = cb * state["lamb_coeff_freeze"] + (1 - cb) * coeff
                    if last_warmup:
                        state["exp_avg_sq_fresh"] = v.clone()
                    p.add_(update, alpha=-group["lr"] * coeff)
                    continue
                if "exp_avg_sq_fresh" not in state:  # freeze_step == 0: no warm-up happened
                    state["exp_avg_sq_fresh"] = v.clone()
                m_prev = m.clone()
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                self._compressed_momentum(state, p, m)
                g_rec = (m - m_prev * b1) / (1 - b1)
                fresh = state["exp_avg_sq_fresh"]
                fresh.mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
                denom = self._denom(v, eps, inside)
                prelim = m / denom
                update = prelim + p * wd if wd > 0 else prelim
                factor = float((denom / self._denom(fresh, eps, inside)).max())
                if wd > 0:
                    u_norm = float(update.float().norm())
                    share = min(1.0, float(prelim.float().norm()) / u_norm) if u_norm > 0 else 1.0
                    factor = factor * share + (1.0 - share)
                factor = min(max(factor, group["factor_min"]), group["factor_max"])
                last = state["last_factor"]
                thr = group["factor_threshold"]
                factor = min(max(factor, last * (1 - thr)), last * (1 + thr))
                state["last_factor"] = factor
                p.add_(update, alpha=-group["lr"] * state["lamb_coeff_freeze"] * factor)
        self.global_step += 1
        return loss


def build_onebit_adam(param_groups: list[dict[str, Any]], ctx: OptimizerContext[OneBitAdamParams]) -> OneBitAdam:
    """OptimizerSpec factory for ``onebitadam``: every constructor argument from the validated params
    model; the compressed all-reduce runs over the runtime's process group."""
    return OneBitAdam(param_groups, **ctx.section.model_dump(), process_group=ctx.runtime.comm.group)


def build_onebit_lamb(param_groups: list[dict[str, Any]], ctx: OptimizerContext[OneBitLambParams]) -> OneBitLamb:
    """OptimizerSpec factory for ``onebitlamb`` (as :func:`build_onebit_adam`)."""
    return OneBitLamb(param_groups, **ctx.section.model_dump(), process_group=ctx.runtime.comm.group)
