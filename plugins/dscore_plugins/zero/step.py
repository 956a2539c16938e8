"""The optimizer step of the partitioned stages (1, 2 and 3), written once.

Order (DeepSpeed's ``DeepSpeedZeroOptimizer.step`` / stage 3's, restated): zero the gradient partitions
if nothing was reduced in this window; unscale, overflow check and clip by the global norm
(:func:`dscore.zero.unscale_clip_for_step`: one scalar all-reduce); skip when the loss scaler says so;
step the optimizer over the fp32 partitions — on the host through
:func:`dscore_plugins.zero.offload.step_offloaded` when the optimizer is offloaded, the single place an
offloaded step runs; publish the updated partitions to the parameters (the stage's all-gather or copy);
zero gradients. Timers: ``step.clip``, ``step.optimizer``, ``step.allgather``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from dscore.protocols.zero import StepOutcome
from dscore.runtime.timers import active_timers, clock
from dscore.zero.optimizer import unscale_clip_for_step
from dscore_plugins.zero.offload import step_offloaded

if TYPE_CHECKING:
    from dscore.comm import Comm
    from dscore.protocols.precision import LossScaler, PrecisionMode

__all__ = ["step_partitions"]


def step_partitions(
    optimizer: torch.optim.Optimizer | None,
    *,
    masters: Sequence[torch.Tensor],
    master_grads: Sequence[torch.Tensor],
    fresh: bool,
    comm: Comm,
    precision: PrecisionMode,
    loss_scaler: LossScaler | None,
    clip: float,
    world: int,
    offload: bool,
    post_divisor: float | None = None,
    publish: Callable[[], None],
    zero_grad: Callable[[], None],
    norm_sq: Callable[[torch.device], torch.Tensor] | None = None,
) -> StepOutcome:
    """One optimizer step of a partitioned stage (see the module docstring).

    Args:
        optimizer: the optimizer over ``masters`` (None: nothing to step, gradients are still dropped).
        masters: every fp32 master partition, in optimizer group order.
        master_grads: the fp32 gradient partitions (reduced, summed over ranks).
        fresh: True when no reduction wrote the gradient partitions in this window (they are zeroed).
        offload: the optimizer state lives on the host (``offload_optimizer``).
        post_divisor: what the reduced gradients still must be divided by (the ``post`` of
            :func:`dscore.zero.reducer.gradient_divisors`); None: the precision's default.
        publish: copies the updated partitions into the parameters (runs after an applied step).
        zero_grad: the stage's ``zero_grad`` (runs last, applied or not).
        norm_sq: the stage's :attr:`~dscore.protocols.zero.ZeroStage.grad_norm_sq` (the whole model's
            squared norm, set by AutoTP), or None: the norm is all-reduced over ``comm``.
    """
    if fresh:
        for g in master_grads:
            g.zero_()
    timers = active_timers()
    t0 = clock(timers)
    norm, skip, overflow = unscale_clip_for_step(
        [g for g in master_grads if g.numel()], comm, precision=precision, loss_scaler=loss_scaler, clip=clip,
        world=world, post_divisor=post_divisor, norm_sq=norm_sq,
    )
    if skip:
        zero_grad()
        return StepOutcome(applied=False, overflow=overflow, global_grad_norm=None)
    t1 = clock(timers)
    if optimizer is not None:
        if offload:
            step_offloaded(optimizer, masters)
        else:
            optimizer.step()
        t2 = clock(timers)
        publish()
        if timers is not None:
            timers.add("step.optimizer", t2 - t1)
            timers.add("step.allgather", clock(timers) - t2)
    if timers is not None:
        timers.add("step.clip", t1 - t0)
    zero_grad()
    return StepOutcome(applied=True, overflow=False, global_grad_norm=norm)
