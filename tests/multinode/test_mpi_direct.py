"""Ranks started by ``mpirun`` (Open MPI, MPICH) and ``srun`` call ``dscore.initialize`` with no dscore
launcher in between: rank, world size and local rank come from the MPI/SLURM variables alone (no
mpi4py installed), for a process group dscore creates and for one the script created itself. 3 ranks:
two on node 1 (local ranks 0 and 1) and one on node 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster, free_port

pytestmark = pytest.mark.slow

TRAIN = str(Path(__file__).resolve().parent / "mn_train.py")


def _launch(cluster: Cluster, kind: str, out: Path, mode: str) -> list[str]:
    n1, n2 = cluster.nodes[0], cluster.nodes[1]
    port = str(free_port())
    rank_cmd = [sys.executable, "-u", TRAIN, "--out", str(out), "--mode", mode, "--steps", "1"]
    env = {"MASTER_ADDR": n1.addr, "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": cluster.iface, "OMP_NUM_THREADS": "1"}
    if kind == "openmpi":
        argv = ["mpirun.openmpi", "-n", "3", "--host", f"{n1.addr}:2,{n2.addr}:1", "--mca", "btl_tcp_if_include",
                cluster.iface, "--mca", "plm_rsh_args", f"-p {cluster.ssh_port}"]  # fmt: skip
        for k, v in env.items():
            argv += ["-x", f"{k}={v}"]
        return argv + rank_cmd
    if kind == "mpich":
        argv = ["mpiexec.hydra", "-localhost", cluster.gateway, "-n", "3", "-hosts", f"{n1.addr}:2,{n2.addr}:1"]
        for k, v in env.items():
            argv += ["-genv", k, v]
        return argv + rank_cmd
    exports = ",".join(f"{k}={v}" for k, v in env.items())
    return ["srun", "-n", "3", "-N", "2", "-w", f"{n1.name},{n2.name}", "-m", "block", f"--export=ALL,{exports}",
            "--kill-on-bad-exit=1", *rank_cmd]  # fmt: skip


@pytest.mark.parametrize(("kind", "mode"), [("openmpi", "existing-group"), ("mpich", "engine"), ("slurm", "existing-group")])
def test_ranks_started_by_mpi_find_their_place(cluster: Cluster, tmp_path: Path, kind: str, mode: str) -> None:
    pytest.importorskip("torch")
    try:
        import mpi4py  # noqa: F401

        pytest.skip("mpi4py is installed: this test checks discovery without it")
    except ImportError:
        pass
    out = tmp_path / "out"
    out.mkdir()
    env = cluster.env(HYDRA_LAUNCHER_EXTRA_ARGS=f"-p {cluster.ssh_port}")
    res = subprocess.run(_launch(cluster, kind, out, mode), env=env, capture_output=True, text=True,
                         timeout=240, cwd=tmp_path, check=False)  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for r, rec in enumerate(ranks):
        assert (rec["rank"], rec["world"]) == (r, 3)
        assert rec["env_before"]["LOCAL_RANK"] is None and rec["env_before"]["RANK"] is None  # no dscore launcher
        assert rec["engine_local_rank"] == [0, 1, 0][r], rec
        assert rec["env_after"]["LOCAL_RANK"] == str([0, 1, 0][r])  # exported for user code
        if cluster.mode == "netns":
            assert rec["addrs"] == [cluster.nodes[[0, 0, 1][r]].addr]
    assert ranks[0]["params"] == ranks[1]["params"] == ranks[2]["params"]
