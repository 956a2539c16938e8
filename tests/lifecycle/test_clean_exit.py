"""A 2-rank ``dscore run`` job that never calls destroy_process_group exits cleanly whatever way the
script ends: normal end, ``sys.exit``, an exception after training, Ctrl-C (KeyboardInterrupt). Never
``terminate called without an active exception`` / SIGABRT / exit 134. A group the user created stays
the user's (still alive in the user's own atexit hook)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("exit_script.py")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dscore", "run", "--num_gpus", "2", str(SCRIPT), "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )


def _no_abort(res: subprocess.CompletedProcess[str]) -> None:
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert "SIGABRT" not in res.stderr and res.returncode != 134, res.stderr[-3000:]


@pytest.mark.parametrize(("end", "stage", "code"), [("normal", 2, 0), ("sys_exit", 3, 0), ("exception", 1, 1)])
def test_exit_is_clean(tmp_path: Path, end: str, stage: int, code: int) -> None:
    res = _run(tmp_path, "--end", end, "--stage", str(stage))
    _no_abort(res)
    assert res.returncode == code, res.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").is_file()
    if end == "exception":
        assert "failure after training" in res.stderr


def test_ctrl_c_after_training_is_clean(tmp_path: Path) -> None:
    res = _run(tmp_path, "--end", "ctrl_c", "--stage", "0")
    _no_abort(res)
    assert "KeyboardInterrupt" in res.stderr
    assert res.returncode in (1, 130), res.stderr[-3000:]  # Python ends an uncaught Ctrl-C by SIGINT


def test_a_user_created_group_stays_the_users(tmp_path: Path) -> None:
    res = _run(tmp_path, "--user_group", "--stage", "2")
    _no_abort(res)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"user_hook{rank}").read_text() == "True", "dscore destroyed the user's group"
        # deterministic check of what makes the exit safe: nothing (dscore, or torch modules imported
        # after the group existed) keeps the group object alive once the user destroyed it, so the
        # destroy joined its worker threads while Python was alive
        assert (tmp_path / f"user_freed{rank}").read_text() == "True", "the destroyed group is still referenced"


@pytest.mark.parametrize("hook", ["early", "late"])
def test_the_users_destroy_ends_its_in_flight_work_cleanly(tmp_path: Path, hook: str) -> None:
    # the user's own collectives are still in flight at exit; the user's hook (registered before dscore's
    # exit hook, or after dscore.initialize and so running first) destroys the group. Before dscore
    # released torch's import-time references to the group, its gloo workers outlived that destroy and
    # dropped these collectives' tensors during finalization: SIGABRT in 11 of 12 runs (2026-12-01).
    extra = ("--late_hook",) if hook == "late" else ()
    res = _run(tmp_path, "--user_group", "--user_inflight", "--stage", "2", *extra)
    _no_abort(res)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"user_hook{rank}").read_text() == "True", "dscore destroyed the user's group"
        assert (tmp_path / f"user_freed{rank}").read_text() == "True", "the destroyed group is still referenced"


INFLIGHT = Path(__file__).with_name("inflight_script.py")


def test_a_user_group_never_destroyed_with_its_work_in_flight_exits_cleanly(tmp_path: Path) -> None:
    # the user's own group, never destroyed, and the user's async all-reduces of temporaries in flight at exit:
    # plain torch aborts (gloo's workers drop the temporaries during finalization: dscore.comm.exit_drain);
    # with DSCORE_EXIT_DRAIN_S=0 (dscore's wait off) 3 of 4 runs aborted (2026-12-01, loaded machine)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "dscore", "run", "--num_gpus", "2", str(INFLIGHT)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    _no_abort(res)
    assert res.returncode == 0, res.stderr[-3000:]
