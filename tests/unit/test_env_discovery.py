"""Environment discovery for init_distributed: precedence, MPI/SLURM/AzureML/SageMaker, disagreement."""

from __future__ import annotations

import sys

import pytest

from dscore.comm.env import DistributedEnv, discover_env, first_slurm_host
from dscore.errors import DistributedError


def ompi(rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }


@pytest.fixture(autouse=True)
def _no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    # importing a None entry raises ImportError: discovery must behave as if mpi4py were not installed
    monkeypatch.setitem(sys.modules, "mpi4py", None)


def test_single_process_fallback_without_any_variables(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="dscore.comm.env"):
        env = discover_env(environ={})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.master_addr == "127.0.0.1" and 0 < env.master_port < 65536
    assert env.source == "single-process"
    assert any("single process" in r.getMessage() for r in caplog.records)


def test_torchrun_variables() -> None:
    env = discover_env(
        environ={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert env == DistributedEnv(3, 8, 1, 2, "10.0.0.1", 1234, "launcher")
    assert env.init_method() == "tcp://10.0.0.1:1234"


def test_openmpi_variables_only_single_node() -> None:
    env = discover_env(environ=ompi(2, 4, 2, 4), distributed_port=29511)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 4, 2, 4)
    assert env.source == "mpi:openmpi"
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29511)


def test_openmpi_multi_node_uses_master_addr() -> None:
    env = discover_env(environ={**ompi(5, 8, 1, 4), "MASTER_ADDR": "node0"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "node0" and env.master_port == 29500


def test_multi_node_mpi_without_master_and_without_mpi4py_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="set MASTER_ADDR.*install mpi4py"):
        discover_env(environ=ompi(5, 8, 1, 4))


def test_mpich_and_intel_mpi_variables() -> None:
    env = discover_env(environ={"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "mpi:mpich")


def test_auto_mpi_discovery_off_ignores_mpi() -> None:
    env = discover_env(environ=ompi(1, 2, 1, 2), auto_mpi_discovery=False)
    assert env.source == "single-process" and env.world_size == 1


def test_disagreeing_world_sizes_name_both_values() -> None:
    with pytest.raises(DistributedError) as info:
        discover_env(environ={**ompi(1, 16, 1, 8), "RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    text = str(info.value)
    assert "WORLD_SIZE=8" in text and "OMPI_COMM_WORLD_SIZE=16" in text


def test_disagreeing_ranks() -> None:
    with pytest.raises(DistributedError, match="RANK=0 .*OMPI_COMM_WORLD_RANK=1"):
        discover_env(environ={**ompi(1, 2, 1, 2), "RANK": "0", "WORLD_SIZE": "2"})


def test_explicit_arguments_must_agree_with_the_launcher() -> None:
    env = discover_env(rank=1, world_size=2, environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size) == (1, 2)
    with pytest.raises(DistributedError, match=r"world_size=4 \(explicit\) but WORLD_SIZE=2 \(launcher\)"):
        discover_env(rank=1, world_size=4, environ={"RANK": "1", "WORLD_SIZE": "2"})


def test_explicit_arguments_alone() -> None:
    env = discover_env(rank=1, world_size=2, environ={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "explicit")
    assert env.master_port == 4000


def test_torchrun_nested_under_mpirun_is_not_a_disagreement() -> None:
    environ = {**ompi(1, 2, 0, 1), "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
               "MASTER_ADDR": "h0", "MASTER_PORT": "29400"}
    env = discover_env(environ={**environ, "TORCHELASTIC_RUN_ID": "abc"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (5, 8, 1, "launcher")
    # the same nesting without torchrun's marker is recognised from the arithmetic (MPI ranks are node ranks)
    assert discover_env(environ=environ).rank == 5


def test_slurm_step_variables() -> None:
    env = discover_env(
        environ={"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
                 "SLURM_JOB_NODELIST": "gpu[007-008]"},
        distributed_port=29600,
    )
    assert env == DistributedEnv(5, 8, 1, 4, "gpu007", 29600, "slurm")


def test_slurm_is_ignored_under_a_launcher() -> None:
    # `srun torchrun ...`: SLURM counts nodes, torchrun counts ranks
    env = discover_env(
        environ={"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                 "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0"}
    )
    assert (env.rank, env.world_size, env.source) == (3, 8, "launcher")


def test_azureml_single_and_multi_node() -> None:
    base = {"AZUREML_EXPERIMENT_ID": "x", "AZ_BATCHAI_MPI_MASTER_NODE": "10.1.1.1", "AZ_BATCH_MASTER_NODE": "10.2.2.2:6000"}
    single = discover_env(environ={**base, **ompi(1, 2, 1, 2)})
    assert (single.source, single.master_addr, single.master_port) == ("azureml", "10.1.1.1", 54965)
    multi = discover_env(environ={**base, **ompi(3, 4, 1, 2)})
    assert (multi.source, multi.master_addr, multi.master_port) == ("azureml", "10.2.2.2", 6105)


def test_sagemaker_needs_master_variables() -> None:
    with pytest.raises(DistributedError, match="SageMaker"):
        discover_env(environ={"SM_TRAINING_ENV": "{}", **ompi(0, 2, 0, 2)})
    env = discover_env(environ={"SM_TRAINING_ENV": "{}", **ompi(0, 2, 0, 2), "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777"})
    assert (env.source, env.master_addr, env.master_port) == ("sagemaker", "algo-1", 7777)


def test_bad_values_are_errors() -> None:
    with pytest.raises(DistributedError, match="RANK='x' must be an integer"):
        discover_env(environ={"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match=r"rank 2 is outside \[0, 2\)"):
        discover_env(environ={"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(DistributedError, match="rank is unknown"):
        discover_env(environ={"WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node1", "node1"), ("a1,b2", "a1"), ("gpu[07-09,12],cpu1", "gpu07"), ("n[3]x", "n3x"), ("rack1-[10-11]", "rack1-10")],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_ipv6_init_method() -> None:
    assert DistributedEnv(0, 1, 0, 1, "::1", 5, "explicit").init_method() == "tcp://[::1]:5"
