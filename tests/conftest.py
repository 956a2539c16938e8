"""Shared fixtures for the dscore test suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import worktree_guard  # tests/ is on sys.path: pytest's default (prepend) import mode puts it there

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


# ---------------------------------------------------------------- one op build per op per whole-suite run
#: set by a whole-suite run: the op cache every tier (and every rank it starts) shares for the session
SHARED_OPS_ENV = "DSCORE_TEST_SHARED_OPS_DIR"


def pytest_configure(config: pytest.Config) -> None:
    """A whole-suite run (``make test``; or ``DSCORE_TEST_SHARED_OPS=1``) compiles each JIT op once, into a
    fresh session cache that every tier uses: the ops tier's real ninja builds (``tests/ops/conftest.py``)
    and the ops the engine tiers load (cpu_adam for offload, shm_sync, async_io), which otherwise went to
    ``~/.cache/torch_extensions`` and were compiled a second time there on a fresh machine (issue 33 item 15).
    A targeted run keeps the per-user cache; an explicit ``TORCH_EXTENSIONS_DIR`` is always kept."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    wanted = os.environ.get("DSCORE_TEST_SHARED_OPS", "1" if whole_suite else "0") not in ("", "0")
    if not wanted or os.environ.get("TORCH_EXTENSIONS_DIR") or os.environ.get(SHARED_OPS_ENV):
        return
    import tempfile

    root = tempfile.mkdtemp(prefix="dscore-test-ops-")
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    os.environ[SHARED_OPS_ENV] = root
    _SHARED_OPS["root"] = root


_SHARED_OPS: dict[str, str] = {}


def pytest_unconfigure(config: pytest.Config) -> None:
    root = _SHARED_OPS.pop("root", None)
    if root is not None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        for var in ("TORCH_EXTENSIONS_DIR", SHARED_OPS_ENV):
            if os.environ.get(var) == root:
                del os.environ[var]


# ---------------------------------------------------------------- the work tree is left as it was found
_WORKTREE: dict[str, object] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Snapshot the checkout (whole-suite runs, or ``DSCORE_CHECK_WORKTREE=1``; see ``worktree_guard``)."""
    whole_suite = session.config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if worktree_guard.check_enabled(whole_suite):
        _WORKTREE["before"] = worktree_guard.snapshot(REPO_ROOT)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail an otherwise green run that left new files or folders in the checkout."""
    before = _WORKTREE.pop("before", None)
    if not isinstance(before, frozenset):
        return
    added = worktree_guard.new_paths(before, worktree_guard.snapshot(REPO_ROOT))
    if added:
        _WORKTREE["message"] = worktree_guard.report(REPO_ROOT, added)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    message = _WORKTREE.pop("message", None)
    if message:
        terminalreporter.section("work tree check", red=True)
        terminalreporter.write_line(str(message))
