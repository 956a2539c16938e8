"""Fixtures of the op tests: one real ninja build per CPU op per session, into a temporary cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def ops_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh ``TORCH_EXTENSIONS_DIR`` for the whole session (so every test run really compiles): in a
    whole-suite run the session cache all tiers share (``tests/conftest.py``; an op another tier built
    first this session is not compiled again), else one of its own."""
    import os

    shared = os.environ.get("DSCORE_TEST_SHARED_OPS_DIR")
    root = Path(shared) if shared else tmp_path_factory.mktemp("torch_extensions")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(root))
        mp.delenv("DSCORE_CPU_SIMD", raising=False)
        yield root


@pytest.fixture(autouse=True)
def _ops_cache_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that use built ops see the session cache even after per-test env resets."""
    if any(name in request.fixturenames for name in ("ops_cache", "cpu_ops", "aio_op")):
        root = request.getfixturevalue("ops_cache")
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))


@pytest.fixture(scope="session")
def cpu_ops(ops_cache: Path) -> dict[str, ModuleType]:
    """cpu_adam, cpu_adagrad and cpu_lion, each compiled once with ninja into ``ops_cache``."""
    from dscore.ops import get_op_builder

    return {name: get_op_builder(name).load() for name in ("cpu_adam", "cpu_adagrad", "cpu_lion")}


@pytest.fixture(scope="session")
def aio_op(ops_cache: Path) -> ModuleType:
    """The ``dscore_plugins.ops.aio`` module with the async_io op compiled once with ninja into ``ops_cache``;
    skips (naming the missing header or library) where libaio is not installed."""
    from dscore_plugins.ops import aio as aio_mod
    from dscore_plugins.ops.aio_builder import AsyncIOBuilder

    ok, reason = AsyncIOBuilder().compatibility()
    if not ok:
        pytest.skip(f"async_io is not buildable here: {reason}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(ops_cache))
        AsyncIOBuilder().load()
    return aio_mod
