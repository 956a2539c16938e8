"""Pipeline schedules as lists of (action, micro-batch) pairs (pure Python, no torch).

:func:`train_schedule` is the one-forward-one-backward (1F1B, PipeDream-flush) schedule DeepSpeed's
``TrainSchedule`` runs: stage ``s`` of ``p`` first runs ``w = min(p - s - 1, m)`` warm-up forwards, then
alternates one forward and one backward until every forward is done, then drains the remaining ``w``
backwards. At most ``p - s`` micro-batches' activations are alive on stage ``s`` (against ``m`` for
all-forwards-then-all-backwards), and the bubble is ``p - 1`` of ``m + p - 1`` slots, so the ideal
efficiency is ``m / (m + p - 1)``.

:func:`inference_schedule` runs the ``m`` forwards in order.
"""

from __future__ import annotations

__all__ = ["FORWARD", "BACKWARD", "inference_schedule", "train_schedule", "bubble_bound"]

FORWARD = "forward"
BACKWARD = "backward"


def train_schedule(micro_batches: int, stages: int, stage_id: int) -> list[tuple[str, int]]:
    """The 1F1B order of work of ``stage_id``: ``[("forward", 0), ..., ("backward", m - 1)]``.

    Raises:
        ValueError: ``micro_batches < 1``, ``stages < 1`` or ``stage_id`` outside ``0..stages-1``.
    """
    if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
        raise ValueError(f"bad schedule arguments: micro_batches={micro_batches}, stages={stages}, stage_id={stage_id}")
    warmup = min(stages - stage_id - 1, micro_batches)
    steps: list[tuple[str, int]] = [(FORWARD, i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < micro_batches:
        steps.append((FORWARD, fwd))
        fwd += 1
        steps.append((BACKWARD, bwd))
        bwd += 1
    while bwd < micro_batches:
        steps.append((BACKWARD, bwd))
        bwd += 1
    return steps


def inference_schedule(micro_batches: int) -> list[tuple[str, int]]:
    """Forwards of ``micro_batches`` micro-batches, in order."""
    return [(FORWARD, i) for i in range(micro_batches)]


def bubble_bound(micro_batches: int, stages: int) -> float:
    """The ideal 1F1B efficiency ``m / (m + p - 1)`` (equal-cost stages, free communication)."""
    return micro_batches / (micro_batches + stages - 1)
