"""The session check in tests/conftest.py fails a run that leaves new files in the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import worktree_guard

TESTS = Path(__file__).resolve().parents[1]


def test_snapshot_skips_caches_and_venvs_and_new_paths_collapse(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x")
    (tmp_path / "src" / "__pycache__").mkdir()
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr")
    before = worktree_guard.snapshot(tmp_path)
    assert before == {"src", "src/a.py"}

    (tmp_path / "src" / "__pycache__" / "a.pyc").write_bytes(b"")
    (tmp_path / ".pytest_cache").mkdir()
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "build" / "lib").mkdir(parents=True)
    (tmp_path / "build" / "lib" / "x.py").write_text("")
    (tmp_path / "src" / "pkg.egg-info").mkdir()
    (tmp_path / ".benchmarks").mkdir()
    after = worktree_guard.snapshot(tmp_path)
    added = worktree_guard.new_paths(before, after)
    assert added == [".benchmarks", "build", "src/pkg.egg-info"]
    message = worktree_guard.report(tmp_path, added)
    assert "3 new path(s)" in message and "build/" in message and "src/pkg.egg-info/" in message


def test_check_enabled_follows_env_then_whole_suite() -> None:
    assert worktree_guard.check_enabled(True, environ={}) is True
    assert worktree_guard.check_enabled(False, environ={}) is False
    assert worktree_guard.check_enabled(False, environ={"DSCORE_CHECK_WORKTREE": "1"}) is True
    assert worktree_guard.check_enabled(True, environ={"DSCORE_CHECK_WORKTREE": "0"}) is False


def _mini_project(root: Path, test_body: str) -> Path:
    """A project using this suite's conftest.py and worktree_guard.py, with one test file."""
    (root / "tests").mkdir(parents=True)
    for name in ("conftest.py", "worktree_guard.py"):
        shutil.copy(TESTS / name, root / "tests" / name)
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "-p no:benchmark"\n')
    (root / "tests" / "test_one.py").write_text(test_body)
    return root


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DSCORE_CHECK_WORKTREE"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


LEAVES_A_FILE = """
from pathlib import Path

def test_writes_into_the_checkout():
    (Path(__file__).resolve().parents[1] / "leftover").mkdir()
    (Path(__file__).resolve().parents[1] / "leftover" / "out.txt").write_text("oops")
"""


def test_a_whole_suite_run_that_leaves_a_file_fails(tmp_path: Path) -> None:
    root = _mini_project(tmp_path / "proj", LEAVES_A_FILE)
    proc = _pytest(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout and "work tree check" in proc.stdout
    assert "leftover/" in proc.stdout and "out.txt" not in proc.stdout


def test_a_clean_whole_suite_run_passes_and_named_paths_skip_the_check(tmp_path: Path) -> None:
    clean = _mini_project(tmp_path / "clean", "def test_ok(tmp_path):\n    (tmp_path / 'f').write_text('x')\n")
    proc = _pytest(clean)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "work tree check" not in proc.stdout
    # a run naming paths is not checked (other work in the checkout could be mistaken for leftovers)
    dirty = _mini_project(tmp_path / "dirty", LEAVES_A_FILE)
    proc = _pytest(dirty, "tests/test_one.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
