"""Soak runs (bench/soak.py): two-rank ``dscore run`` jobs cycling ZeRO stages 0-3 with and without
optimizer offload, each saving a checkpoint, random ports, two jobs at a time; any non-zero exit,
incomplete checkpoint or leftover file fails the test.

The suite runs 8 jobs (each of the 7 stage/offload combinations at least once; 20 took ~210 s of a loaded 2-core
machine, the largest single test of the suite, issue 33 item 15); ``DSCORE_SOAK_RUNS=20`` (or more) soaks
longer, e.g. before a release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


RUNS = int(os.environ.get("DSCORE_SOAK_RUNS", "8"))


def test_soak_runs_all_exit_zero(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(SOAK), "--runs", str(RUNS), "--steps", "1", "--parallel", "2", "--quiet", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    data = json.loads(out.read_text())
    summary = data["summary"]
    bad = [r for r in data["runs"] if r["cause"] != "ok"]
    assert summary["runs"] == RUNS
    assert summary["nonzero_or_incomplete"] == 0, json.dumps(bad, indent=1)[-4000:]
    assert summary["checkpoints_incomplete"] == 0
    assert summary["tmpdir_files_left"] == 0, [r["tmp_left"] for r in data["runs"]]
    assert summary["dev_shm_left"] == [], summary
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
