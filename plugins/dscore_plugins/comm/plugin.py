"""Manifest of the comm plugin: the comm backends for ``torch.distributed``, the transports, the comms logger.

* Each :class:`~dscore.specs.CommBackendSpec` says which torch backend name to pass to
  ``init_process_group``, which device types it moves tensors for, and which modules must be importable
  first. ``dscore.init_distributed`` checks the selected backend against the accelerator's device type
  (asking for nccl on CPU is an error that suggests gloo).
* Two :class:`~dscore.specs.CommTransportSpec` units the collective facade asks per call, above its native
  fallback: ``shm`` (same-host shared memory, priority 200; needs the ``shm_sync`` op registered here) and
  ``p2p`` (gloo point-to-point, priority 100). ``plugins.disable: ["comm_transport:shm"]`` leaves the
  pairwise collectives on gloo point-to-point; ``DSCORE_SHM=0`` does the same.
* The ``comms_logger`` config section, whose unit also provides ``dscore.comm.configure`` / ``log_summary``
  (:mod:`dscore.comm.comms_logger` re-exports :mod:`dscore_plugins.comm.comms_logger`).
"""

from __future__ import annotations

from typing import Any

from dscore import hookimpl
from dscore.specs import CommBackendSpec, CommTransportSpec, ConfigSectionSpec, OpBuilderSpec

__all__ = [
    "dscore_engine_created",
    "dscore_register_comm_backends",
    "dscore_register_comm_transports",
    "dscore_register_config_sections",
    "dscore_register_op_builders",
]


@hookimpl
def dscore_register_comm_backends() -> list[CommBackendSpec]:
    """Register gloo, nccl, ccl, xccl, hccl and mpi."""
    return [
        CommBackendSpec(
            name="gloo",
            torch_backend="gloo",
            device_types=("cpu", "cuda", "mps"),
            description="Facebook gloo: CPU tensors (CUDA tensors for the common collectives); always built",
        ),
        CommBackendSpec(
            name="nccl",
            torch_backend="nccl",
            device_types=("cuda",),
            description="NVIDIA NCCL (RCCL on ROCm): CUDA tensors only",
        ),
        CommBackendSpec(
            name="ccl",
            aliases=("oneccl",),
            torch_backend="ccl",
            device_types=("cpu", "xpu"),
            requires=("oneccl_bindings_for_pytorch",),
            description="Intel oneCCL through oneccl_bindings_for_pytorch: CPU and XPU tensors",
        ),
        CommBackendSpec(
            name="xccl",
            torch_backend="xccl",
            device_types=("xpu",),
            description="torch's built-in oneCCL backend for XPU tensors (torch >= 2.8)",
        ),
        CommBackendSpec(
            name="hccl",
            torch_backend="hccl",
            device_types=("hpu", "npu"),
            description="Habana/Ascend HCCL: registered by the hpu or npu accelerator's vendor package",
        ),
        CommBackendSpec(
            name="mpi",
            torch_backend="mpi",
            device_types=("cpu", "cuda"),
            description="MPI: needs a torch built with MPI support (torch.distributed.is_mpi_available())",
        ),
    ]


@hookimpl
def dscore_register_comm_transports() -> list[CommTransportSpec]:
    """``shm`` above ``p2p``: a group whose ranks share this host takes shared memory, others gloo
    point-to-point (both only for CPU tensors on gloo with ``DSCORE_GLOO_NATIVE`` unset)."""
    return [
        CommTransportSpec(
            name="shm",
            factory="dscore_plugins.comm.shm.transport:make_transport",
            priority=200,
            op_builders=("shm_sync",),
            description="same-host shared memory (memfd segments, futexes): pairwise exchanges and all-reduces",
        ),
        CommTransportSpec(
            name="p2p",
            factory="dscore_plugins.comm.p2p:make_transport",
            priority=100,
            description="gloo point-to-point: all-gathers and sum/average reduce-scatters as pairwise exchanges",
        ),
    ]


@hookimpl
def dscore_register_op_builders() -> list[OpBuilderSpec]:
    """The ``shm_sync`` op of the shm transport (``csrc/comm/shm_sync.cpp``)."""
    return [
        OpBuilderSpec(
            name="shm_sync",
            builder="dscore_plugins.comm.shm.builder:ShmSyncBuilder",
            device_types=("cpu",),
            build_env_var="DS_BUILD_SHM_SYNC",
            description="release/acquire words + futex wait/wake of the shared-memory transport",
        )
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``comms_logger`` section (model in :mod:`dscore_plugins.comm.config`); its ``exports`` module
    provides :mod:`dscore.comm.comms_logger`'s names."""
    return [
        ConfigSectionSpec(
            name="comms_logger",
            model="dscore_plugins.comm.config:CommsLoggerConfig",
            description="collective size/latency logging",
            exports="dscore_plugins.comm.comms_logger",
        )
    ]


@hookimpl
def dscore_engine_created(engine: Any) -> None:
    """Configure the process's comms logger from an enabled ``comms_logger`` block (DeepSpeed configures
    ``deepspeed.comm`` from the engine's config the same way); a disabled block leaves it as it is."""
    section = engine.config.section("comms_logger", None)
    if section is None or not section.enabled:
        return
    from dscore_plugins.comm.comms_logger import configure

    configure(
        enabled=True, prof_all=section.prof_all, prof_ops=section.prof_ops, verbose=section.verbose,
        debug=section.debug,
    )  # fmt: skip
