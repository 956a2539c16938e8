"""``dscore.init_distributed`` in real processes: fallback, MPI variables, an existing group, backend checks."""

from __future__ import annotations

import os
import sys

import pytest

from dscore.testing import run_distributed

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _single_process_fallback() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    import dscore
    from dscore.errors import DistributedError
    from dscore.runtime.context import current_runtime, use_runtime
    from dscore.runtime.runtime import Runtime

    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)
    for var in [v for v in os.environ if v.startswith(("OMPI_", "PMI_", "SLURM_", "MV2_"))]:
        del os.environ[var]
    sys.modules["mpi4py"] = None  # type: ignore[assignment]  # as if mpi4py were not installed

    out: dict[str, object] = {}
    try:
        dscore.init_distributed(dist_backend="nccl")
    except DistributedError as exc:
        out["nccl_error"] = str(exc)
    try:
        dscore.init_distributed(dist_init_required=False)
    except DistributedError as exc:
        out["not_required_error"] = str(exc)
    assert not dist.is_initialized()

    class Recorder:
        calls: list[tuple[int, int, str]] = []

        @dscore.hookimpl
        def dscore_distributed_initialized(self, rank: int, world_size: int, backend: str) -> None:
            self.calls.append((rank, world_size, backend))

    from dscore.plugin_manager import create_plugin_manager

    comm = dscore.init_distributed(plugin_manager=create_plugin_manager(extra_plugins=[("recorder", Recorder())]))
    assert comm.env is not None
    out["hook_calls"] = list(Recorder.calls)
    out["env"] = (comm.env.rank, comm.env.world_size, comm.env.local_rank, comm.env.source, comm.env.master_addr)
    out["backend"] = (comm.backend, str(dist.get_backend()))
    out["exported"] = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])
    t = torch.ones(2)
    comm.all_reduce(t, op="avg")
    assert torch.equal(t, torch.ones(2))

    again = dscore.init_distributed()  # idempotent: reuses the group
    out["again_source"] = again.env.source if again.env else None
    try:
        dscore.init_distributed(dist_backend="mpi")
    except DistributedError as exc:
        out["other_backend_error"] = str(exc)

    runtime = Runtime.create(accelerator="cpu")
    out["runtime"] = (runtime.accelerator.device_type, runtime.accelerator_reason, runtime.comm.get_world_size())
    with use_runtime(runtime):
        assert current_runtime() is runtime
        assert dscore.comm.active_comm() is runtime.comm
    return out


def test_single_process_fallback_nccl_on_cpu_and_idempotence() -> None:
    [out] = run_distributed(_single_process_fallback, 1, init_process_group=False, timeout=120)
    assert "nccl" in out["nccl_error"] and "dist_backend='gloo'" in out["nccl_error"]
    assert "accelerator is 'cpu'" in out["nccl_error"]
    assert "dist_init_required=False" in out["not_required_error"]
    assert out["env"] == (0, 1, 0, "single-process", "127.0.0.1")
    assert out["hook_calls"] == [(0, 1, "gloo")]
    assert out["backend"] == ("gloo", "gloo")
    assert out["exported"] == ("0", "1", "0")
    assert out["again_source"] == "existing-process-group"
    assert "already exists with backend 'gloo'" in out["other_backend_error"]
    assert "dist_backend='mpi'" in out["other_backend_error"]
    assert out["runtime"][0] == "cpu" and out["runtime"][1].startswith("accelerator='cpu'") and out["runtime"][2] == 1


def _openmpi_variables_only() -> tuple[int, int, int, str, float]:
    import torch

    import dscore

    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        del os.environ[var]
    os.environ.update(
        {
            "OMPI_COMM_WORLD_RANK": rank,
            "OMPI_COMM_WORLD_SIZE": world,
            "OMPI_COMM_WORLD_LOCAL_RANK": rank,
            "OMPI_COMM_WORLD_LOCAL_SIZE": world,
        }
    )
    sys.modules["mpi4py"] = None  # type: ignore[assignment]
    comm = dscore.init_distributed()
    assert comm.env is not None
    t = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(t)
    return comm.env.rank, comm.env.world_size, comm.get_local_rank(), comm.env.source, t.item()


def test_openmpi_variables_only_map_to_rank_local_rank_world_size() -> None:
    results = run_distributed(_openmpi_variables_only, 2, init_process_group=False, timeout=120)
    assert results == [(0, 2, 0, "mpi:openmpi", 3.0), (1, 2, 1, "mpi:openmpi", 3.0)]


def _reuse_existing_group() -> tuple[str, int, int, str]:
    import torch.distributed as dist

    import dscore
    from dscore.errors import DistributedError

    group_before = dist.group.WORLD
    comm = dscore.init_distributed(dist_backend="gloo")
    assert dist.group.WORLD is group_before
    try:
        dscore.init_distributed(dist_backend="nccl")
    except DistributedError as exc:
        message = str(exc)
    else:
        raise AssertionError("asking for nccl on an existing gloo group must fail")
    assert comm.env is not None
    return comm.env.source, comm.get_rank(), comm.get_world_size(), message


def test_pre_existing_process_group_is_reused() -> None:
    results = run_distributed(_reuse_existing_group, 2, timeout=120)
    for rank, (source, got_rank, world, message) in enumerate(results):
        assert (source, got_rank, world) == ("existing-process-group", rank, 2)
        assert "already exists with backend 'gloo'" in message and "dist_backend='nccl'" in message


def test_disagreeing_sources_fail_before_any_process_group_with_both_values() -> None:
    import torch.distributed as dist

    import dscore
    from dscore.errors import DistributedError

    environ = {"RANK": "0", "WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "16"}
    with pytest.raises(DistributedError, match=r"WORLD_SIZE=8 \(launcher\) but OMPI_COMM_WORLD_SIZE=16"):
        dscore.init_distributed(environ=environ)
    assert not dist.is_initialized()
