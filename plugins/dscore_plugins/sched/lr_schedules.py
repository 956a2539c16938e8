"""DeepSpeed's LR schedulers: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Behaviour mirrored: DeepSpeed 0.19.8 ``deepspeed/runtime/lr_schedules.py`` (formulas restated in
``deepspeed-behaviour.md`` §3); written from the formulas, not copied. Conventions shared by all five:

* ``last_batch_iteration`` (``t``) starts at -1; at construction with ``t == -1`` the initial lr is
  written into every param group.
* ``step(i=None)`` sets ``t = i`` if given else ``t + 1`` and writes :meth:`get_lr` into the groups, so the
  first optimizer step always runs at the initial lr (the engine steps the scheduler after the optimizer).
* ``state_dict()`` is exactly ``{"last_batch_iteration": t}``; ``load_state_dict`` restores only ``t``
  (the groups' lr is rewritten at the next ``step``).
* Scalar parameters broadcast to every param group; lists must have one value per group.

Learning rates are Python floats in the optimizer's units (per step). Tensor-valued ``lr`` entries in
param groups (``torch.optim`` capturable mode) are filled in place.

Deliberate differences from DeepSpeed (listed in ``docs/defaults.md``):

* ``WarmupLR`` without ``warmup_max_lr`` takes each group's own lr (DeepSpeed's newer code takes the
  first group's lr for every group, discarding per-group lrs).
* Before the first step ``WarmupLR``/``WarmupCosineLR.get_lr()`` return one value per param group
  (DeepSpeed returns a one-element list, leaving groups after the first untouched).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dscore.errors import ConfigError, DscoreError

if TYPE_CHECKING:
    from dscore.protocols import SchedulerContext
    from dscore_plugins.sched.config import (
        LRRangeTestParams,
        OneCycleParams,
        WarmupCosineLRParams,
        WarmupDecayLRParams,
        WarmupLRParams,
    )

__all__ = [
    "LRSchedulerBase",
    "SchedulerNotSteppedError",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "build_lr_range_test",
    "build_one_cycle",
    "build_warmup_cosine_lr",
    "build_warmup_decay_lr",
    "build_warmup_lr",
]

log = logging.getLogger("dscore.sched")

_DEEPSPEED_WARMUP_DECAY_MAX_LR = 0.001
_LOG = "log"
_LINEAR = "linear"


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise ConfigError(f"an LR scheduler needs an optimizer with param_groups, got {type(optimizer).__name__}")
    return groups


def _per_group(optimizer: Any, value: float | Sequence[float], name: str) -> list[float]:
    """Broadcast ``value`` to one float per param group.

    Raises:
        ConfigError: a list/tuple whose length differs from the number of param groups.
    """
    n = len(_groups(optimizer))
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(
                f"expected {n} value(s) for {name} (one per param group), got {len(value)}: {list(value)!r}",
                path=f"scheduler.params.{name}",
            )
        return [float(v) for v in value]
    return [float(value)] * n


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}", path=f"scheduler.params.{name}")
    return value


def _write_lrs(optimizer: Any, lrs: Sequence[float]) -> list[float]:
    """Write ``lrs`` into the param groups (tensor lrs in place) and return them as floats."""
    for group, lr in zip(_groups(optimizer), lrs):
        current = group.get("lr")
        if current is not None and hasattr(current, "fill_"):
            current.fill_(lr)
        else:
            group["lr"] = lr
    return [float(v) for v in lrs]


def _warmup_type(value: str) -> str:
    if value not in (_LOG, _LINEAR):
        log.warning("unknown warmup_type %r; using 'log' (valid: 'log', 'linear')", value)
        return _LOG
    return value


def _warmup_fraction(t: int, warmup_steps: int, warmup_type: str) -> float:
    """gamma(t) in [0, 1) during warm-up: ln(t+1)/ln(W) (log) or t/W (linear); 1 after."""
    if t >= warmup_steps:
        return 1.0
    if warmup_type == _LOG:
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps



class SchedulerNotSteppedError(DscoreError, RuntimeError, AssertionError):
    """``get_last_lr()`` before any learning rate was written (DeepSpeed asserts "need to call step() first")."""

class LRSchedulerBase:
    """Shared step/state plumbing. Subclasses implement :meth:`get_lr` for the current ``t``.

    Attributes:
        optimizer: the optimizer whose ``param_groups[i]["lr"]`` is written.
        last_batch_iteration: ``t``, the index of the last step taken (-1 before the first).
    """

    optimizer: Any
    last_batch_iteration: int
    _last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current ``t`` (floats)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs written by the last ``step`` (or the constructor).

        Raises:
            SchedulerNotSteppedError: nothing was written yet (constructed with ``last_batch_iteration != -1``
                and not stepped); a RuntimeError and, as DeepSpeed's assert, an AssertionError (Hugging Face
                Trainer catches that one, reading "need to call step").
        """
        if self._last_lr is None:
            raise SchedulerNotSteppedError("get_last_lr(): need to call step() first (no learning rate written yet)")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default ``t + 1``) and write the new lrs."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": t}`` exactly (DeepSpeed's layout)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``t`` and write the lr at ``t`` into the groups, so ``get_last_lr()`` and the optimizer
        agree after a load (DeepSpeed restores ``t`` only: its ``get_last_lr()`` keeps the constructor's lr,
        DeepSpeed #3875). With the optimizer state loaded the groups already hold that lr; without it the
        first step after the load uses the resumed lr instead of the initial one."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if self.last_batch_iteration >= 0:
            self._last_lr = _write_lrs(self.optimizer, self.get_lr())


class WarmupLR(LRSchedulerBase):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``W`` steps, then hold it.

    ``W = max(2, warmup_num_steps)``; ``lr(t) = min + (max - min) * gamma(t)`` with
    ``gamma = ln(t+1)/ln(W)`` (log) or ``t/W`` (linear) for ``t < W``, 1 afterwards, and ``lr = min`` for
    ``t < 0``. ``warmup_max_lr=None`` takes each param group's current lr.

    Raises:
        ConfigError: ``warmup_num_steps`` not a positive int, or a per-group list of the wrong length.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = _LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = optimizer
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in _groups(optimizer)]
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(optimizer, self.get_lr())

    def _gamma(self) -> float:
        return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        """``min + (max - min) * gamma(t)`` per group; ``min`` before the first step."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then decay linearly to ``warmup_min_lr`` at ``total_num_steps`` and stay there.

    After warm-up, ``gamma(t) = max(0, (T - t) / max(1, T - W))``. ``warmup_max_lr`` defaults to 0.001
    as in DeepSpeed (not to the optimizer's lr); ``None`` takes each param group's lr. A
    ``total_num_steps`` smaller than ``warmup_num_steps`` only warns, as in DeepSpeed.

    Raises:
        ConfigError: ``total_num_steps`` or ``warmup_num_steps`` not a positive int.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = _DEEPSPEED_WARMUP_DECAY_MAX_LR,
        warmup_num_steps: int = 1000,
        warmup_type: str = _LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedulerBase):
    """Scale each param group's *original* lr by a ratio: warm-up, then cosine decay (DeepSpeed).

    ``r(t) = 0`` for ``t < 0``; ``wmin + (1 - wmin) * gamma(t)`` during warm-up; afterwards with
    ``p = min(1, (t - W + 1) / max(1, T - W))``, ``r = max(0, cmin + (1 - cmin) * (1 + cos(pi p)) / 2)``.
    ``lr = original_lr * r``. The optimizer's lr at construction is the peak; ``warmup_max_lr`` does not
    exist for this scheduler.

    Raises:
        ConfigError: ``total_num_steps`` or ``warmup_num_steps`` not a positive int.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = _LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        if self.total_num_steps < self.warmup_num_steps:
            log.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )
        self.org_lrs = [float(g["lr"]) for g in _groups(optimizer)]
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The ratio ``r(t)`` applied to the original lrs."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            gamma = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """``original_lr * r(t)`` per group."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(LRSchedulerBase):
    """The 1-cycle policy (Smith, arXiv:1803.09820) as DeepSpeed implements it.

    With ``S = s1 + s2`` and ``rho = s1 / S``, for ``n = t + 1``: ``x = 1 + n/S - floor(1 + n/S)``;
    ``f = x / rho`` while ``x <= rho`` else ``(x - 1) / (rho - 1)``. A positive stair count ``k`` of the
    current half quantises ``f`` from the integer position in the cycle, ``c = n mod S``:
    ``f = floor(c k / s1) / k`` in the rising half (``c <= s1``), ``floor((S - c) k / s2) / k`` in the
    falling one (DeepSpeed's rule; flooring the float ``f`` instead loses a whole stair to rounding, one
    step behind DeepSpeed). While ``t < S``: ``lr = min + (max - min) f`` and
    ``beta1 = max_mom - (max_mom - min_mom) f``. Afterwards, with ``d = t - S + 1``:
    ``lr = min / (1 + decay_lr_rate d / decay_step_size)`` and
    ``beta1 = max_mom (1 + decay_mom_rate d / decay_step_size)``; each decay is off (constant ``min`` /
    ``max_mom``) when its rate or ``decay_step_size`` is ~0.

    ``cycle_min_lr``, ``cycle_max_lr``, ``cycle_min_mom`` and ``cycle_max_mom`` take one float for every
    param group or a list with one value per group (the types DeepSpeed documents for them).

    Momentum cycling writes ``betas = (beta1, 0.99)`` (DeepSpeed overwrites beta2 with 0.99) and is
    disabled with a warning when the optimizer's ``defaults`` have no ``betas``.

    Raises:
        ConfigError: ``cycle_first_step_size <= 0``, ``cycle_second_step_size < 0``, or a per-group list
            whose length differs from the number of param groups (the key is named).
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: float = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = optimizer
        if cycle_first_step_size <= 0:
            raise ConfigError(
                f"cycle_first_step_size must be > 0, got {cycle_first_step_size!r}",
                path="scheduler.params.cycle_first_step_size",
            )
        if cycle_second_step_size is not None and cycle_second_step_size < 0:
            raise ConfigError(
                f"cycle_second_step_size must be >= 0, got {cycle_second_step_size!r}",
                path="scheduler.params.cycle_second_step_size",
            )
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = (
            self.first_stair_count if cycle_second_stair_count is None else int(cycle_second_stair_count)
        )
        self.decay_step_size = float(decay_step_size)
        no_decay = math.isclose(self.decay_step_size, 0.0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0.0)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0.0)
        self.cycle_momentum = bool(cycle_momentum)
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        if self.cycle_momentum and "betas" not in getattr(optimizer, "defaults", {}):
            log.warning(
                "OneCycle: cycle_momentum disabled because %s has no 'betas' in its defaults",
                type(optimizer).__name__,
            )
            self.cycle_momentum = False
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(optimizer, self.min_lrs)
            if self.cycle_momentum:
                for group, mom in zip(_groups(optimizer), self.min_moms):
                    group["betas"] = mom

    def _scale_factor(self) -> float:
        n = self.last_batch_iteration + 1
        x = 1.0 + n / self.total_size - math.floor(1.0 + n / self.total_size)
        if x <= self.step_ratio:
            f = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            f = (x - 1.0) / (self.step_ratio - 1.0)
            stairs = self.second_stair_count
        if stairs > 0:
            # From the integer position, not from f: f can land 1 ulp under a stair edge.
            c = n % self.total_size
            if c <= self.first_step_size:
                position = c * stairs / self.first_step_size
            else:
                position = (self.total_size - c) * stairs / self.second_step_size
            f = math.floor(position) / stairs
        return f

    def get_lr(self) -> list[float]:
        """lr per group at the current ``t`` (cycle, then decay)."""
        t = self.last_batch_iteration
        if t < self.total_size:
            f = self._scale_factor()
            return [lo + (hi - lo) * f for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * (t - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``betas`` per group at the current ``t``, or None when momentum cycling is off."""
        if not self.cycle_momentum:
            return None
        t = self.last_batch_iteration
        if t < self.total_size:
            f = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * f, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * (t - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance ``t`` and write lr (and ``betas`` when cycling momentum)."""
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            for group, mom in zip(_groups(self.optimizer), moms):
                group["betas"] = mom


class LRRangeTest(LRSchedulerBase):
    """LR range test (Smith, arXiv:1506.01186): ``lr = min_lr * (1 + rate * interval)``.

    ``interval = (t + 1) / step_size`` (continuous) or ``floor((t + 1) / step_size)`` (staircase).

    Raises:
        ConfigError: ``lr_range_test_step_size`` not a positive int, or a per-group list of the wrong length.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = optimizer
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(optimizer, self.min_lr)

    def _interval(self) -> float:
        ratio = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(ratio)) if self.staircase else ratio

    def get_lr(self) -> list[float]:
        """``min_lr * (1 + rate * interval)`` per group."""
        increase = 1.0 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


# ---------------------------------------------------------------------------------------------------
# LRSchedulerSpec factories: ``factory(optimizer, ctx)``. The params models hold every default and their
# field names are the constructors' keyword arguments, so each factory hands over the validated model.
# ---------------------------------------------------------------------------------------------------
def build_warmup_lr(optimizer: Any, ctx: SchedulerContext[WarmupLRParams]) -> WarmupLR:
    """``WarmupLR`` from the validated ``scheduler.params``."""
    return WarmupLR(optimizer, **ctx.section.model_dump())


def build_warmup_decay_lr(optimizer: Any, ctx: SchedulerContext[WarmupDecayLRParams]) -> WarmupDecayLR:
    """``WarmupDecayLR`` from the validated ``scheduler.params``."""
    return WarmupDecayLR(optimizer, **ctx.section.model_dump())


def build_warmup_cosine_lr(optimizer: Any, ctx: SchedulerContext[WarmupCosineLRParams]) -> WarmupCosineLR:
    """``WarmupCosineLR`` from the validated ``scheduler.params``."""
    return WarmupCosineLR(optimizer, **ctx.section.model_dump())


def build_one_cycle(optimizer: Any, ctx: SchedulerContext[OneCycleParams]) -> OneCycle:
    """``OneCycle`` from the validated ``scheduler.params``."""
    return OneCycle(optimizer, **ctx.section.model_dump())


def build_lr_range_test(optimizer: Any, ctx: SchedulerContext[LRRangeTestParams]) -> LRRangeTest:
    """``LRRangeTest`` from the validated ``scheduler.params``."""
    return LRRangeTest(optimizer, **ctx.section.model_dump())
