"""``examples/mlp/train.py`` runs as a plain script and reaches >= 90% held-out accuracy on sklearn digits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

REPO = Path(__file__).resolve().parents[2]


def test_mlp_example_trains_to_90_percent() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "mlp" / "train.py"), "--epochs", "8"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"held-out accuracy: ([0-9.]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert float(match.group(1)) >= 0.90
    assert "step=" in proc.stderr  # steps_per_print progress lines went through logging
