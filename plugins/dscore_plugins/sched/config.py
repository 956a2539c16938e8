"""Pydantic models of ``scheduler.params`` for the built-in LR schedulers (torch-free).

Field names, defaults and validation mirror DeepSpeed 0.19.8 ``deepspeed/runtime/lr_schedules.py``
(see ``deepspeed-behaviour.md`` §3 and ``docs/defaults.md``). ``WarmupDecayLR.warmup_max_lr`` defaults to
DeepSpeed's ``0.001`` (not the optimizer's lr, unlike ``WarmupLR``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from dscore.config.base import Float

__all__ = [
    "SchedulerParams",
    "WarmupLRParams",
    "WarmupDecayLRParams",
    "WarmupCosineLRParams",
    "OneCycleParams",
    "LRRangeTestParams",
]

#: a learning rate: one float for every param group, or one per group.
LRValue = Float | list[Float]
PositiveInt = Annotated[StrictInt, Field(gt=0)]


class SchedulerParams(BaseModel):
    """Base of every scheduler params model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    last_batch_iteration: StrictInt = -1
    """Index of the last batch already trained (-1 starts the schedule from the beginning)."""


class WarmupLRParams(SchedulerParams):
    """``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr`` then hold."""

    warmup_min_lr: LRValue = 0.0
    """Learning rate at step 0 (float, or one per param group)."""
    warmup_max_lr: LRValue | None = None
    """Learning rate after warm-up; None takes each param group's ``lr`` at construction."""
    warmup_num_steps: PositiveInt = 1000
    """Warm-up length in optimizer steps (a positive int; values below 2 act as 2)."""
    warmup_type: str = "log"
    """``"log"`` or ``"linear"``; anything else warns and uses ``"log"`` (as DeepSpeed)."""


class WarmupDecayLRParams(WarmupLRParams):
    """``WarmupDecayLR``: ``WarmupLR`` followed by a linear decay to ``warmup_min_lr`` at ``total_num_steps``."""

    warmup_max_lr: LRValue | None = 0.001
    """Learning rate after warm-up: DeepSpeed's default 0.001 (None takes each param group's ``lr``)."""
    total_num_steps: PositiveInt
    """Step at which the learning rate reaches ``warmup_min_lr`` (required)."""


class WarmupCosineLRParams(SchedulerParams):
    """``WarmupCosineLR``: a ratio of each group's original lr, warmed up then cosine-decayed."""

    total_num_steps: PositiveInt
    """Total optimizer steps of the schedule (required)."""
    warmup_min_ratio: Float = 0.0
    """Ratio of the original lr at step 0."""
    warmup_num_steps: PositiveInt = 1000
    """Warm-up length in optimizer steps (values below 2 act as 2)."""
    cos_min_ratio: Float = 0.0001
    """Ratio reached at the end of the cosine phase."""
    warmup_type: str = "log"
    """``"log"`` or ``"linear"``."""


class OneCycleParams(SchedulerParams):
    """``OneCycle`` (Smith, arXiv:1803.09820): one triangular lr/momentum cycle then an optional decay."""

    cycle_min_lr: LRValue
    """Lower lr of the cycle (required; float, or one per param group)."""
    cycle_max_lr: LRValue
    """Upper lr of the cycle (required; float, or one per param group)."""
    decay_lr_rate: Float = 0.0
    """lr decay rate after the cycle (0 disables)."""
    cycle_first_step_size: PositiveInt = 2000
    """Steps of the rising half."""
    cycle_second_step_size: Annotated[StrictInt, Field(ge=0)] | None = None
    """Steps of the falling half (None: same as the first)."""
    cycle_first_stair_count: Annotated[StrictInt, Field(ge=0)] = 0
    """Stairs in the rising half (0 = continuous)."""
    cycle_second_stair_count: Annotated[StrictInt, Field(ge=0)] | None = None
    """Stairs in the falling half (None: same as the first)."""
    decay_step_size: Annotated[Float, Field(ge=0)] = 0
    """Interval of the post-cycle decay in steps (0 disables decay)."""
    cycle_momentum: StrictBool = True
    """Cycle ``betas[0]`` inversely to the lr (needs an optimizer with ``betas``)."""
    cycle_min_mom: LRValue = 0.8
    """Lower momentum (beta1) of the cycle (float, or one per param group)."""
    cycle_max_mom: LRValue = 0.9
    """Upper momentum (beta1) of the cycle (float, or one per param group)."""
    decay_mom_rate: Float = 0.0
    """Momentum decay rate after the cycle (0 disables)."""


class LRRangeTestParams(SchedulerParams):
    """``LRRangeTest`` (Smith, arXiv:1506.01186): grow the lr linearly (or in stairs) from a minimum."""

    lr_range_test_min_lr: LRValue = 1e-3
    """Initial lr (float, or one per param group)."""
    lr_range_test_step_size: PositiveInt = 2000
    """Steps per lr increase interval."""
    lr_range_test_step_rate: Float = 1.0
    """Increase per interval, as a multiple of the minimum lr."""
    lr_range_test_staircase: StrictBool = False
    """Increase in whole intervals instead of continuously."""
