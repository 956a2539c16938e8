"""Shared fixtures for the dscore test suite."""

from __future__ import annotations

import os
import sys
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
def _clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without the blocking variables a developer may have exported."""
    for var in ("DSCORE_DISABLE_PLUGINS", "DSCORE_DISABLE_PLUGIN_AUTOLOAD", "DSCORE_PLUGINS", "DS_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
