"""Manifest of the built-in comm backends for ``torch.distributed``.

Each :class:`~dscore.specs.CommBackendSpec` says which torch backend name to pass to
``init_process_group``, which device types it moves tensors for, and which modules must be importable
first. ``dscore.init_distributed`` checks the selected backend against the accelerator's device type
(asking for nccl on CPU is an error that suggests gloo).
"""

from __future__ import annotations

from typing import Any

from dscore import hookimpl
from dscore.specs import CommBackendSpec, ConfigSectionSpec

__all__ = ["dscore_engine_created", "dscore_register_comm_backends", "dscore_register_config_sections"]


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
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``comms_logger`` section (model in :mod:`dscore_plugins.comm.config`)."""
    return [
        ConfigSectionSpec(
            name="comms_logger",
            model="dscore_plugins.comm.config:CommsLoggerConfig",
            description="collective size/latency logging",
        )
    ]


@hookimpl
def dscore_engine_created(engine: Any) -> None:
    """Configure the process's comms logger from an enabled ``comms_logger`` block (DeepSpeed configures
    ``deepspeed.comm`` from the engine's config the same way); a disabled block leaves it as it is."""
    section = engine.config.section("comms_logger", None)
    if section is None or not section.enabled:
        return
    from dscore.comm.comms_logger import configure

    configure(
        enabled=True, prof_all=section.prof_all, prof_ops=section.prof_ops, verbose=section.verbose,
        debug=section.debug,
    )  # fmt: skip
