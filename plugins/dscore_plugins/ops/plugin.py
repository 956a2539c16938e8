"""Manifest of the ``ops`` plugin: op builders and the optimizers built on them (specs only, no torch)."""

from __future__ import annotations

from collections.abc import Iterable

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, OpBuilderSpec, OptimizerSpec

_B = "dscore_plugins.ops.builders"
_CPU = "dscore_plugins.ops.cpu_optim"
_CUDA = "dscore_plugins.ops.fused_optim"
_CFG = "dscore_plugins.ops.config"


@hookimpl
def dscore_register_op_builders() -> Iterable[OpBuilderSpec]:
    return [
        OpBuilderSpec(name="cpu_adam", builder=f"{_B}:CPUAdamBuilder", device_types=("cpu",),
                      build_env_var="DS_BUILD_CPU_ADAM", description="Adam/AdamW on CPU (SIMD + OpenMP), fp16/bf16 copy"),
        OpBuilderSpec(name="cpu_adagrad", builder=f"{_B}:CPUAdagradBuilder", device_types=("cpu",),
                      build_env_var="DS_BUILD_CPU_ADAGRAD", description="Adagrad on CPU (SIMD + OpenMP)"),
        OpBuilderSpec(name="cpu_lion", builder=f"{_B}:CPULionBuilder", device_types=("cpu",),
                      build_env_var="DS_BUILD_CPU_LION", description="Lion on CPU (SIMD + OpenMP)"),
        OpBuilderSpec(name="fused_adam", builder=f"{_B}:FusedAdamBuilder", device_types=("cuda",),
                      build_env_var="DS_BUILD_FUSED_ADAM", description="multi-tensor fused Adam/AdamW (CUDA)"),
        OpBuilderSpec(name="fused_lamb", builder=f"{_B}:FusedLambBuilder", device_types=("cuda",),
                      build_env_var="DS_BUILD_FUSED_LAMB", description="multi-tensor fused LAMB (CUDA)"),
        OpBuilderSpec(name="fused_lion", builder=f"{_B}:FusedLionBuilder", device_types=("cuda",),
                      build_env_var="DS_BUILD_FUSED_LION", description="multi-tensor fused Lion (CUDA)"),
        OpBuilderSpec(name="async_io", builder="dscore_plugins.ops.aio_builder:AsyncIOBuilder", device_types=("cpu",),
                      build_env_var="DS_BUILD_AIO", description="file I/O of host tensors via kernel AIO (libaio)"),
    ]


@hookimpl
def dscore_register_config_sections() -> Iterable[ConfigSectionSpec]:
    """The ``aio`` section tuning the async_io op (model in :mod:`dscore.config.aio`)."""
    return [ConfigSectionSpec(name="aio", model="dscore.config.aio:AioConfig", description="async_io op tuning")]


@hookimpl
def dscore_register_optimizers() -> Iterable[OptimizerSpec]:
    """The op-backed optimizers. The CPU ones are offload-capable; all but FusedLamb are ZeRO-safe
    (DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS)."""
    return [
        OptimizerSpec(name="DscoreCPUAdam", aliases=("cpu_adam", "DeepSpeedCPUAdam"), factory=f"{_CPU}:build_cpu_adam",
                      params_model=f"{_CFG}:CPUAdamParams", classes=(f"{_CPU}:DscoreCPUAdam",),
                      offload_capable=True, zero_supported=True,
                      description="Adam/AdamW stepping fp32 CPU params (ZeRO offload)"),
        OptimizerSpec(name="DscoreCPUAdagrad", aliases=("cpu_adagrad", "DeepSpeedCPUAdagrad"),
                      factory=f"{_CPU}:build_cpu_adagrad", params_model=f"{_CFG}:AdagradParams",
                      classes=(f"{_CPU}:DscoreCPUAdagrad",), offload_capable=True, zero_supported=True,
                      description="Adagrad stepping fp32 CPU params (ZeRO offload)"),
        OptimizerSpec(name="DscoreCPULion", aliases=("cpu_lion", "DeepSpeedCPULion"), factory=f"{_CPU}:build_cpu_lion",
                      params_model=f"{_CFG}:LionParams", classes=(f"{_CPU}:DscoreCPULion",),
                      offload_capable=True, zero_supported=True,
                      description="Lion stepping fp32 CPU params (ZeRO offload)"),
        OptimizerSpec(name="FusedAdam", aliases=("fused_adam",), factory=f"{_CUDA}:build_fused_adam",
                      params_model=f"{_CFG}:FusedAdamParams", classes=(f"{_CUDA}:FusedAdam",), zero_supported=True,
                      description="multi-tensor fused Adam/AdamW on CUDA"),
        OptimizerSpec(name="FusedLamb", aliases=("fused_lamb",), factory=f"{_CUDA}:build_fused_lamb",
                      params_model=f"{_CFG}:FusedLambParams", classes=(f"{_CUDA}:FusedLamb",),
                      description="multi-tensor fused LAMB on CUDA"),
        OptimizerSpec(name="FusedLion", aliases=("fused_lion",), factory=f"{_CUDA}:build_fused_lion",
                      params_model=f"{_CFG}:LionParams", classes=(f"{_CUDA}:FusedLion",), zero_supported=True,
                      description="multi-tensor fused Lion on CUDA"),
    ]
