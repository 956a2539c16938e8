"""Manifest of the built-in LR schedulers (torch-free: specs only).

DeepSpeed's ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest``
(``dscore_plugins.sched.lr_schedules``), plus the spec ``"torch"``: the fallback the engine calls with a
:class:`dscore.protocols.TorchClassParams` section for any ``torch.optim.lr_scheduler`` class.
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import LRSchedulerSpec

__all__ = ["SCHEDULER_SPECS", "dscore_register_lr_schedulers"]

_MOD = "dscore_plugins.sched.lr_schedules"
_CFG = "dscore_plugins.sched.config"

SCHEDULER_SPECS: tuple[LRSchedulerSpec, ...] = (
    LRSchedulerSpec(
        name="WarmupLR",
        exports=_MOD,
        factory=f"{_MOD}:build_warmup_lr",
        params_model=f"{_CFG}:WarmupLRParams",
        description="warm up from warmup_min_lr to warmup_max_lr (log or linear), then hold (DeepSpeed)",
    ),
    LRSchedulerSpec(
        name="WarmupDecayLR",
        exports=_MOD,
        factory=f"{_MOD}:build_warmup_decay_lr",
        params_model=f"{_CFG}:WarmupDecayLRParams",
        description="WarmupLR then linear decay to warmup_min_lr at total_num_steps (DeepSpeed)",
    ),
    LRSchedulerSpec(
        name="WarmupCosineLR",
        exports=_MOD,
        factory=f"{_MOD}:build_warmup_cosine_lr",
        params_model=f"{_CFG}:WarmupCosineLRParams",
        description="warm-up then cosine decay of a ratio of the optimizer lr (DeepSpeed)",
    ),
    LRSchedulerSpec(
        name="OneCycle",
        exports=_MOD,
        factory=f"{_MOD}:build_one_cycle",
        params_model=f"{_CFG}:OneCycleParams",
        description="1-cycle lr/momentum policy with post-cycle decay (DeepSpeed)",
    ),
    LRSchedulerSpec(
        name="LRRangeTest",
        exports=_MOD,
        factory=f"{_MOD}:build_lr_range_test",
        params_model=f"{_CFG}:LRRangeTestParams",
        description="LR range test: lr grows linearly or in stairs (DeepSpeed)",
    ),
    LRSchedulerSpec(
        name="torch",
        factory="dscore_plugins.sched.torch_sched:torch_scheduler_factory",
        description="fallback: any torch.optim.lr_scheduler class by name",
    ),
)


@hookimpl
def dscore_register_lr_schedulers() -> tuple[LRSchedulerSpec, ...]:
    """The built-in schedulers and the ``torch`` fallback."""
    return SCHEDULER_SPECS
