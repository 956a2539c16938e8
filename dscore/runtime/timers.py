"""Wall-clock timers for ``wall_clock_breakdown`` (forward / backward / step times).

Mirrors DeepSpeed's ``SynchronizedWallClockTimer`` in spirit: each timer synchronizes the accelerator
before reading the clock, so device work is attributed to the phase that queued it. Timers exist only
when ``wall_clock_breakdown`` is true; the engine does not call them otherwise (no per-step cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PhaseTimers"]


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
        self._total[name] = self._total.get(name, 0.0) + time.perf_counter() - began
        self._count[name] = self._count.get(name, 0) + 1

    def mean_ms(self, reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per call of every timer since the last reset (then reset when asked)."""
        out = {k: 1000.0 * v / max(1, self._count[k]) for k, v in self._total.items()}
        if reset:
            self._total.clear()
            self._count.clear()
        return out
