"""Shared fixtures for the dscore test suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def python_exe() -> str:
    """The interpreter running the tests (the project's venv)."""
    return sys.executable


@pytest.fixture(autouse=True)
def _isolate_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts without the plugin-blocking variables a developer may have exported, and leaves
    no trace for the next: ``init_distributed`` exports RANK/WORLD_SIZE/... into ``os.environ`` (as
    DeepSpeed does) and an in-process test may leave a default process group or a current runtime."""
    for var in ("DSCORE_DISABLE_PLUGINS", "DSCORE_DISABLE_PLUGIN_AUTOLOAD", "DSCORE_PLUGINS", "DS_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved_env = dict(os.environ)
    context = sys.modules.get("dscore.runtime.context")
    saved_runtime = context.peek_runtime() if context is not None else None
    yield
    os.environ.clear()
    os.environ.update(saved_env)
    if "torch.distributed" in sys.modules:  # never import torch just for the clean-up
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    context = sys.modules.get("dscore.runtime.context")
    if context is not None:
        context.set_runtime(saved_runtime)
