"""The test device (examples/plugins/dscore-testdevice) must be installed in the test environment.

``make setup`` installs it; a venv made before that (or by hand) gets it here, once per session, with
pip (``--no-deps -e``, a few seconds), so ``make test`` on a fresh clone and ``pytest tests/testdevice``
in an older venv both run the device tests instead of skipping them.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

DIST = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "dscore-testdevice"


def _installed() -> bool:
    return any(ep.name == "testdevice" for ep in importlib.metadata.entry_points(group="dscore"))


@pytest.fixture(scope="session", autouse=True)
def testdevice_distribution() -> None:
    """Install dscore-testdevice into this interpreter's environment when it is missing."""
    if _installed():
        return
    with FileLock(str(Path(sys.prefix) / ".dscore-testdevice-install.lock")):
        if not _installed():
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "-e", str(DIST)],
                capture_output=True, text=True, check=False,
            )
            if proc.returncode != 0:
                pytest.fail(f"installing {DIST} failed:\n{proc.stdout}\n{proc.stderr}")
    importlib.invalidate_caches()
    assert _installed(), "dscore-testdevice was installed but its entry point is not visible"
