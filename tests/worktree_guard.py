"""The test suite must leave the work tree as it found it: every test writes only to temp dirs.

``tests/conftest.py`` takes a :func:`snapshot` of the checkout when the session starts and compares it
with another when the session finishes; any path that appeared (``.benchmarks/``, a ``build/`` or
``*.egg-info`` of a pip-installed example, a ``runs/`` folder of a script started in the repo, ...) fails
the run with the list. Caches that tools keep by design (``__pycache__``, ``.pytest_cache``,
``.ruff_cache``, ``.hypothesis``) and virtual environments are not part of the comparison.

The check is on for a whole-suite run (``pytest`` / ``make test`` with no path arguments, which is what CI
runs) and off when a run names files or folders, because then other work in the same checkout (a file
saved in an editor while the tests run) could be mistaken for a test's leftover. ``DSCORE_CHECK_WORKTREE=1``
forces it on, ``=0`` off.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["CACHE_DIRS", "ENV_VAR", "check_enabled", "new_paths", "report", "snapshot"]

#: directories skipped wherever they appear: git itself and caches kept by design
CACHE_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".mypy_cache"})
ENV_VAR = "DSCORE_CHECK_WORKTREE"


def check_enabled(whole_suite: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to compare snapshots: ``$DSCORE_CHECK_WORKTREE`` (``1``/``0``) when set, else ``whole_suite``."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return whole_suite


def snapshot(root: Path) -> frozenset[str]:
    """Relative POSIX paths of every file, link and directory under ``root``, minus :data:`CACHE_DIRS`
    and virtual environments (a directory holding ``pyvenv.cfg``). Entries that vanish during the walk
    are simply not listed."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _err: None):
        keep = []
        for name in dirnames:
            if name in CACHE_DIRS or (Path(dirpath, name) / "pyvenv.cfg").exists():
                continue
            keep.append(name)
        dirnames[:] = keep
        base = Path(dirpath).relative_to(root)
        for name in (*keep, *filenames):
            found.add((base / name).as_posix())
    return frozenset(found)


def new_paths(before: Iterable[str], after: Iterable[str]) -> list[str]:
    """Paths in ``after`` but not in ``before``, sorted; inside a new directory only the directory itself
    is listed (``build/`` rather than every file in it)."""
    added = sorted(set(after) - set(before))
    top: list[str] = []
    for path in added:
        if not any(path.startswith(parent + "/") for parent in top):
            top.append(path)
    return top


def report(root: Path, paths: list[str]) -> str:
    """The failure message naming each leftover (directories with a trailing ``/``)."""
    shown = [p + "/" if (root / p).is_dir() else p for p in paths]
    return (
        f"the test session left {len(shown)} new path(s) in the work tree {root}; tests must write only to "
        "temp dirs (tmp_path, or copy sources there before building them):\n  " + "\n  ".join(shown)
    )
