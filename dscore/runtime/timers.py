"""Wall-clock timers for ``wall_clock_breakdown`` (forward / backward / step and their sub-phases).

Mirrors DeepSpeed's ``SynchronizedWallClockTimer`` in spirit: each timer synchronizes the accelerator
before reading the clock, so device work is attributed to the phase that queued it. Timers exist only
when ``wall_clock_breakdown`` is true; the engine does not call them otherwise (no per-step cost).

Sub-phases. The engine times ``forward``, ``backward`` and ``step`` as a whole; a ZeRO stage splits them
further by reading :func:`active_timers` (``None`` unless some engine in this process runs with
``wall_clock_breakdown: true``, so the disabled cost is one global lookup per hook or phase). Names used:

* ``backward.bucket``: copying gradients into reduce buckets / staging buffers (inside ``backward``);
* ``backward.reduce_launch``: launching asynchronous reductions (inside ``backward``);
* ``backward.reduce_wait``: waiting for reductions still in flight when autograd is done;
* ``step.clip``: global-norm computation, unscale and clip; ``step.optimizer``: the optimizer itself;
* ``step.allgather``: launching and waiting for the parameter all-gather (stages 1-2 finish it inside
  ``step`` so parameters are current when it returns; stage 3 copies into its partitions);
* ``forward.allgather_wait``: stage-3 forward pre-hooks waiting for parameter gathers and prefetches.

``backward`` minus its sub-phases is autograd compute; sub-phases of one parent may overlap the
parent's compute only in the sense that their time is spent on the same thread (there is one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PhaseTimers", "active_timers", "clock"]

_ACTIVE: PhaseTimers | None = None


def active_timers() -> PhaseTimers | None:
    """The timers of the most recently built engine with ``wall_clock_breakdown: true`` in this process,
    or ``None`` (the common case: callers skip timing entirely)."""
    return _ACTIVE


def clock(timers: PhaseTimers | None) -> float:
    """A clock read for a sub-phase: :meth:`PhaseTimers.now` (synchronizes the device first, so queued
    device work is charged to the phase that queued it) when ``timers`` are active, else a plain
    ``time.perf_counter()`` (no synchronization when nobody measures). Seconds."""
    return time.perf_counter() if timers is None else timers.now()


class PhaseTimers:
    """Accumulating named timers.

    Args:
        synchronize: called before every clock read (``accelerator.synchronize``); may be a no-op.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self._sync = synchronize or (lambda: None)
        self._start: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._lifetime: dict[str, float] = {}

    def activate(self) -> PhaseTimers:
        """Make these the process's :func:`active_timers` (so ZeRO stages record sub-phases); returns self."""
        global _ACTIVE
        _ACTIVE = self
        return self

    def deactivate(self) -> None:
        """Stop being the active timers (no-op when others were activated since)."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def now(self) -> float:
        """Synchronize the device, then read the clock (seconds, ``time.perf_counter``)."""
        self._sync()
        return time.perf_counter()

    def start(self, name: str) -> None:
        """Start (or restart) timer ``name``."""
        self._sync()
        self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        """Stop timer ``name`` and add the elapsed seconds to its total.

        Raises:
            KeyError: ``name`` was not started.
        """
        self._sync()
        began = self._start.pop(name)
        self.add(name, time.perf_counter() - began)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to timer ``name`` as one call (for spans measured by the caller)."""
        self._total[name] = self._total.get(name, 0.0) + seconds
        self._count[name] = self._count.get(name, 0) + 1
        self._lifetime[name] = self._lifetime.get(name, 0.0) + seconds

    def totals(self) -> dict[str, tuple[float, int]]:
        """``{name: (total seconds, calls)}`` since the last reset (no reset)."""
        return {k: (v, self._count[k]) for k, v in self._total.items()}

    def lifetime_totals(self) -> dict[str, float]:
        """``{name: total seconds}`` since the timers were created (never reset; for readers that take
        differences over a span, such as the flops profiler)."""
        return dict(self._lifetime)

    def reset(self) -> None:
        """Forget every total and count (running timers keep running)."""
        self._total.clear()
        self._count.clear()

    def mean_ms(self, reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per call of every timer since the last reset (then reset when asked)."""
        out = {k: 1000.0 * v / max(1, self._count[k]) for k, v in self._total.items()}
        if reset:
            self.reset()
        return out
