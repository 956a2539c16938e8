"""Helpers for the launcher tests: run ``dscore run`` as a real subprocess and inspect processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "worker.py")
TRAIN = str(HERE / "train_gloo.py")


def dscore_cmd(*args: str) -> list[str]:
    """argv running ``dscore run <args>`` with this interpreter."""
    return [sys.executable, "-m", "dscore", "run", *args]


def free_port() -> int:
    from dscore.testing.distributed import find_free_port

    return find_free_port()


def launcher_env(**extra: str) -> dict[str, str]:
    """Environment for a launcher subprocess: no inherited visible-devices or accelerator settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "DS_ENV_FILE")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def wait_for_files(paths: list[Path], proc: subprocess.Popen[bytes] | None = None, timeout: float = 90) -> None:
    """Hang guard: wait until every path exists (fails early if ``proc`` exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"launcher exited with {proc.returncode} before {paths} appeared:\n{out}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {paths}")


def read_ranks(outdir: Path, world: int) -> list[dict]:
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]


def alive(pids: list[int]) -> list[int]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
