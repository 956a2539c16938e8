"""PhaseTimers (``wall_clock_breakdown``) and the stage-3 host allocation policy."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dscore.errors import ConfigError
from dscore.runtime.timers import PhaseTimers, active_timers


def test_active_timers_registry_and_totals() -> None:
    assert active_timers() is None or isinstance(active_timers(), PhaseTimers)
    t = PhaseTimers().activate()
    try:
        assert active_timers() is t
        t.add("backward.reduce_wait", 0.5)
        t.add("backward.reduce_wait", 0.25)
        t.start("step")
        t.stop("step")
        totals = t.totals()
        assert totals["backward.reduce_wait"] == (0.75, 2)
        assert totals["step"][1] == 1 and totals["step"][0] >= 0.0
        assert t.mean_ms(reset=False)["backward.reduce_wait"] == pytest.approx(375.0)
        t.reset()
        assert t.totals() == {}
        with pytest.raises(KeyError):
            t.stop("never-started")
        other = PhaseTimers()
        other.deactivate()  # not active: leaves t in place
        assert active_timers() is t
    finally:
        t.deactivate()
    assert active_timers() is None


def test_malloc_policy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore_plugins.zero import host_memory as stage3

    monkeypatch.setattr(stage3, "_malloc_policy_applied", False)
    monkeypatch.setenv("DSCORE_MALLOC_MMAP_THRESHOLD", "lots")
    with pytest.raises(ConfigError, match="DSCORE_MALLOC_MMAP_THRESHOLD"):
        stage3.apply_host_malloc_policy()
    monkeypatch.setenv("DSCORE_MALLOC_MMAP_THRESHOLD", "0")
    assert stage3.apply_host_malloc_policy() == 0  # disabled
    assert stage3.apply_host_malloc_policy() == 0  # once per process
    # applying it changes the whole process's allocator: do that in a child, not in the test runner
    env = {**os.environ, "DSCORE_MALLOC_MMAP_THRESHOLD": str(4 << 20)}
    code = "from dscore_plugins.zero.stage3 import apply_host_malloc_policy as a; print(a(), a())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert out.stdout.split() == [str((4 << 20) if glibc else 0), "0"]
