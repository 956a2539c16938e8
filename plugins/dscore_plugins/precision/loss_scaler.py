"""fp16 loss scalers: static, and dynamic with DeepSpeed's two algorithms.

Source mirrored: DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` (ZeRO stages) and the inline
``_update_scale`` of ``deepspeed/runtime/fp16/{fused,unfused}_optimizer.py`` (no ZeRO); restated in
``deepspeed-behaviour.md`` §5.1. Scales are Python floats (dimensionless factors the loss is multiplied
by before backward).

Both dynamic algorithms share the growth rule: with ``cur_iter`` counting calls to :meth:`update` and
``last_overflow_iter`` the last overflowing call, after a clean step ``stable = cur_iter -
last_overflow_iter - 1``; when ``stable > 0 and stable % loss_scale_window == 0`` the scale doubles.
They differ on overflow:

* ``"fp16_optimizer"`` (ZeRO stage 0): halve at once, clamped at ``min_loss_scale``; hysteresis settings
  are ignored.
* ``"zero"`` (stages 1-3): spend one unit of hysteresis per overflow while more than one is left (scale
  unchanged); when none is left, halve (clamped at ``min_loss_scale``). ``consecutive_hysteresis``
  refills the hysteresis after every clean step; otherwise it is refilled when the scale grows.

At the minimum both behave the same (:meth:`DynamicLossScaler._shrink_or_raise`, the one place that
decides): an overflow that would have to lower the scale while it already is ``min_loss_scale`` raises
:class:`LossScaleUnderflowError`, on every ZeRO stage. This is DeepSpeed's loss-scaler rule
(``DynamicLossScaler`` with its default ``raise_error_at_min_scale=True``, used by ZeRO 1-3). DeepSpeed's
stage-0 fp16 optimizers instead clamp and keep skipping every step silently; dscore does not copy that,
since a run that can never step again must stop, and the same config must not behave differently by stage.

Every overflowing :meth:`update` returns True: the optimizer step must be skipped.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from dscore.errors import DscoreError
from dscore.protocols.precision import LossScaler

__all__ = ["DynamicLossScaler", "LossScaleUnderflowError", "StaticLossScaler", "ScalerAlgorithm"]

log = logging.getLogger("dscore.precision")

ScalerAlgorithm = Literal["fp16_optimizer", "zero"]


class LossScaleUnderflowError(DscoreError, FloatingPointError):
    """The ZeRO dynamic loss scaler is at ``min_loss_scale`` and gradients still overflow.

    DeepSpeed raises a bare ``Exception("Current loss scale already at minimum - cannot decrease scale
    anymore. Exiting run.")`` in this case; dscore raises this subclass of ``FloatingPointError``.
    """


class StaticLossScaler(LossScaler):
    """A fixed loss scale (``fp16.loss_scale > 0``, or 1.0 for modes without scaling).

    Overflowing steps are still skipped (DeepSpeed's fp16 optimizers and ZeRO check overflow with a
    static scale too); the scale never changes.

    Args:
        scale: the factor (> 0).

    Raises:
        ValueError: ``scale`` is not a positive finite number (as :class:`dscore.errors.DscoreError`).
    """

    def __init__(self, scale: float) -> None:
        if not (scale > 0 and scale != float("inf")):
            raise _config_error(
                f"a static loss scale must be a positive finite number, got {scale!r}", "fp16.loss_scale"
            )
        self._scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> bool:
        """Return ``overflow`` (skip the step on overflow); the scale is unchanged."""
        if overflow:
            log.info("fp16 overflow with static loss scale %s: skipping step", self._scale)
        return bool(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": False, "cur_scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["cur_scale"])


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling with either of DeepSpeed's algorithms (see the module docstring).

    Args:
        init_scale: starting scale, ``2 ** fp16.initial_scale_power``.
        scale_window: ``fp16.loss_scale_window``, clean steps between doublings (> 0).
        min_scale: ``fp16.min_loss_scale`` (> 0).
        hysteresis: ``fp16.hysteresis`` (>= 1), overflows tolerated before halving ("zero" only).
        consecutive_hysteresis: ``fp16.consecutive_hysteresis`` ("zero" only).
        algorithm: ``"fp16_optimizer"`` (no ZeRO) or ``"zero"`` (ZeRO stages 1-3).
        scale_factor: growth/shrink factor (2.0 in DeepSpeed).

    Attributes:
        cur_scale, cur_iter, last_overflow_iter, cur_hysteresis: the state machine (checkpointed).

    Raises:
        ConfigError: non-positive ``scale_window``/``min_scale``/``init_scale``, ``hysteresis < 1`` or an
            unknown ``algorithm``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: float = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        *,
        algorithm: ScalerAlgorithm = "zero",
        scale_factor: float = 2.0,
    ) -> None:
        if algorithm not in ("fp16_optimizer", "zero"):
            raise _config_error(f"unknown loss scaling algorithm {algorithm!r}; valid: 'fp16_optimizer', 'zero'", "")
        if not init_scale > 0:
            raise _config_error(f"initial loss scale must be > 0, got {init_scale!r}", "fp16.initial_scale_power")
        if not scale_window > 0:
            raise _config_error(f"loss_scale_window must be > 0, got {scale_window!r}", "fp16.loss_scale_window")
        if not min_scale > 0:
            raise _config_error(f"min_loss_scale must be > 0, got {min_scale!r}", "fp16.min_loss_scale")
        if hysteresis < 1:
            raise _config_error(f"hysteresis must be >= 1, got {hysteresis!r}", "fp16.hysteresis")
        self.algorithm: ScalerAlgorithm = algorithm
        self.scale_window = int(scale_window) if float(scale_window).is_integer() else float(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.scale_factor = float(scale_factor)
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> bool:
        """Advance the state machine by one boundary; return ``overflow`` (True = skip the step).

        Raises:
            LossScaleUnderflowError: the scale must be lowered (no hysteresis left, or the
                ``"fp16_optimizer"`` algorithm) and it already is ``min_loss_scale`` (either algorithm).
        """
        if overflow:
            if self.algorithm == "fp16_optimizer" or self.hysteresis == 1 or self.cur_hysteresis == 1:
                self._shrink_or_raise()
            else:
                self.cur_hysteresis -= 1
                log.info(
                    "fp16 overflow: hysteresis left %d, loss scale kept at %s", self.cur_hysteresis, self.cur_scale
                )
            self.last_overflow_iter = self.cur_iter
        else:
            if self.algorithm == "zero" and self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if self.algorithm == "zero" and not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
                log.info("no fp16 overflow for %d steps: loss scale raised to %s", self.scale_window, self.cur_scale)
        self.cur_iter += 1
        return bool(overflow)

    def _shrink_or_raise(self) -> None:
        """Lower the scale (clamped at the minimum), or raise when it already is the minimum."""
        if self.cur_scale == self.min_scale:  # DeepSpeed's test (a scale below the minimum is first raised to it)
            raise LossScaleUnderflowError(
                f"fp16 gradients overflow with the loss scale already at fp16.min_loss_scale={self.min_scale:g} "
                f"(step {self.cur_iter} of the loss scaler); it cannot be lowered further and every step would "
                "be skipped. Lower fp16.min_loss_scale, check the model and data for inf/NaN, or use bf16."
            )
        new = max(self.cur_scale / self.scale_factor, self.min_scale)
        log.info("fp16 overflow: loss scale %s -> %s, skipping step", self.cur_scale, new)
        self.cur_scale = new

    def state_dict(self) -> dict[str, Any]:
        return {
            "dynamic": True,
            "algorithm": self.algorithm,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state machine (the configured window, minimum and hysteresis are kept)."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state.get("cur_hysteresis", self.hysteresis))


def _config_error(message: str, path: str) -> Exception:
    from dscore.errors import ConfigError

    return ConfigError(message, path=path)
