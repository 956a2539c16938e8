"""Local rank of an existing process group from the launcher's variables (fast, no processes)."""

from __future__ import annotations

import pytest

from dscore.comm.env import existing_group_env
from dscore.errors import DistributedError
from dscore.launcher.node import parse_failure_line


@pytest.mark.parametrize(
    ("environ", "local", "local_world", "source"),
    [
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 3, 4, ""),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 1, 2, "+mpi:openmpi"),  # fmt: skip
        ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, 1, 2, "+mpi:mpich"),
        ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "3", "MV2_COMM_WORLD_LOCAL_RANK": "1"}, 1, 3,
         "+mpi:mvapich"),  # fmt: skip
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"}, 1, 2,
         "+slurm"),  # fmt: skip
        # variables of another job (size differs from the group's): not used, single-node assumption
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, 1, 3, ""),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0"}, 1, 3, ""),
        ({}, 1, 3, ""),
    ],
)
def test_existing_group_local_rank_sources(environ: dict[str, str], local: int, local_world: int, source: str) -> None:
    env = existing_group_env(1, 3, environ={"MASTER_ADDR": "h0", "MASTER_PORT": "29501", **environ})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 3, local, local_world)
    assert env.source == "existing-process-group" + source
    assert (env.master_addr, env.master_port) == ("h0", 29501)


def test_existing_group_bad_value_is_named() -> None:
    with pytest.raises(DistributedError, match="OMPI_COMM_WORLD_LOCAL_RANK='x'"):
        existing_group_env(0, 2, environ={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                          "OMPI_COMM_WORLD_LOCAL_RANK": "x"})  # fmt: skip
    assert existing_group_env(0, 1, environ={}).local_rank == 0


def test_failure_lines_seen_through_pdsh_mpirun_and_srun() -> None:
    line = "dscore.launcher.node: node 1 failed: rank 1 (host n2) exited with code 7 [exit code 7]"
    assert parse_failure_line(f"10.0.0.2: {line}") == (7, "node 1 on 10.0.0.2: rank 1 (host n2) exited with code 7")
    assert parse_failure_line(line.replace("node 1 failed", "rank 3 failed"))[0] == 7  # type: ignore[index]
    assert parse_failure_line("pdsh@vm: 10.0.0.2: ssh exited with exit code 255") == (
        255, "the node launcher on 10.0.0.2 exited with code 255")  # fmt: skip
    assert parse_failure_line("pdsh@vm: 10.0.0.2: ssh exited with exit code 0") is None
    assert parse_failure_line("rank 1: training dscore.launcher.node: node 1 failed: x") is None
