"""Session fixtures of the multi-node tier: one throw-away cluster (sshd per node, Slurm) for all tests.

``DSCORE_MULTINODE_LOOPBACK=1`` forces the loopback fallback even where namespaces work.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster, can_use_netns, missing_programs  # noqa: E402


def _force_loopback() -> bool:
    return os.environ.get("DSCORE_MULTINODE_LOOPBACK", "") not in ("", "0")


def pytest_report_header(config: pytest.Config) -> str:
    mode = "loopback (forced)" if _force_loopback() else ("netns" if can_use_netns() else "loopback (no CAP_NET_ADMIN)")
    missing = missing_programs()
    return f"dscore multi-node fixture: {mode}" + (f"; missing programs: {', '.join(missing)}" if missing else "")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Three nodes with sshd each, plus munged/slurmctld/slurmd; torn down (and checked) at session end."""
    missing = missing_programs()
    if missing:
        pytest.skip(
            f"multi-node tier needs {', '.join(missing)} (Debian: apt-get install openssh-server openssh-client pdsh "
            "openmpi-bin mpich slurm-wlm munge; .ci/run installs them)"
        )
    root = Path(tempfile.mkdtemp(prefix="dscore-mn-"))
    c = Cluster.start(root, n_nodes=3, force_loopback=_force_loopback())
    try:
        c.start_slurm()
        print(f"\n{c.describe()}; slurm: {c.slurm_conf}", file=sys.stderr)
        yield c
    finally:
        c.close()
        left = c.leftovers()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"multi-node fixture left things behind: {left}"
