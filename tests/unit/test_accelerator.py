"""The accelerator base class and the built-in accelerators (CPU fully; others where their device exists)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from dscore.accelerator import (
    Accelerator,
    Capabilities,
    DeviceControl,
    LaunchEnv,
    MemoryStats,
    ProbeResult,
    RngControl,
    StreamsAndEvents,
)
from dscore.errors import AcceleratorError
from dscore_accelerators.cpu.accelerator import CpuAccelerator
from dscore_accelerators.cuda.accelerator import CudaAccelerator
from dscore_accelerators.mps.accelerator import MpsAccelerator
from dscore_accelerators.xpu.accelerator import XpuAccelerator


@pytest.fixture
def cpu() -> CpuAccelerator:
    return CpuAccelerator()


def test_cpu_satisfies_every_protocol(cpu: CpuAccelerator) -> None:
    for protocol in (DeviceControl, StreamsAndEvents, MemoryStats, RngControl, Capabilities, LaunchEnv):
        assert isinstance(cpu, protocol), protocol.__name__


def test_cpu_device_control(cpu: CpuAccelerator) -> None:
    assert cpu.device_type == "cpu"
    assert cpu.device_name() == "cpu" and cpu.device_name(3) == "cpu"
    assert cpu.device() == torch.device("cpu") and cpu.device(1) == torch.device("cpu")
    assert cpu.current_device() == 0 and cpu.current_device_name() == "cpu"
    assert cpu.device_count() == 1
    assert cpu.is_available() is True
    cpu.set_device(0)
    cpu.set_device(5)  # any local rank is accepted: all ranks share the host
    with pytest.raises(AcceleratorError, match="must be >= 0"):
        cpu.set_device(-1)
    cpu.synchronize()
    assert cpu.is_synchronized_device() is True


def test_cpu_memory_stats_are_bytes(cpu: CpuAccelerator) -> None:
    before = cpu.memory_allocated()
    blob = torch.ones(8 * 1024 * 1024, dtype=torch.uint8)  # 8 MiB touched
    after = cpu.memory_allocated()
    assert isinstance(before, int) and before > 1024 * 1024  # a Python process with torch is > 1 MiB
    assert after >= before - 4 * 1024 * 1024
    assert cpu.max_memory_allocated() >= after
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_allocated() >= cpu.memory_allocated() - 4 * 1024 * 1024
    total, available = cpu.total_memory(), cpu.available_memory()
    assert total > available > 0
    assert total > after
    assert cpu.memory_reserved() > 0
    cpu.empty_cache()
    del blob


def test_cpu_rng_state_round_trip(cpu: CpuAccelerator) -> None:
    cpu.manual_seed(1234)
    assert cpu.initial_seed() == 1234
    state = cpu.get_rng_state()
    assert state.dtype == torch.uint8
    first = torch.rand(4)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)
    cpu.manual_seed_all(7)
    a = torch.rand(3)
    cpu.manual_seed(7)
    assert torch.equal(torch.rand(3), a)


def test_cpu_streams_events_and_pinning(cpu: CpuAccelerator) -> None:
    stream = cpu.Stream()
    with cpu.stream(stream):
        x = torch.ones(2) * 2
    event = cpu.Event()
    event.record()
    event.synchronize()
    assert cpu.current_stream() is not None
    assert cpu.pin_memory(x) is x and cpu.is_pinned(x) is False
    assert cpu.on_accelerator(x) is True


def test_cpu_capabilities(cpu: CpuAccelerator) -> None:
    assert cpu.is_bf16_supported() is True
    caps = torch.cpu.get_capabilities()
    assert cpu.is_fp16_supported() is bool(caps.get("amx_fp16") or caps.get("avx512_fp16"))
    dtypes = cpu.supported_dtypes()
    assert dtypes[0] == torch.float32 and torch.bfloat16 in dtypes
    assert (torch.float16 in dtypes) is cpu.is_fp16_supported()


def test_cpu_launch_env(cpu: CpuAccelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu.visible_devices_envs() == []
    assert cpu.export_envs() == []
    assert cpu.launch_env({"NCCL_DEBUG": "INFO"}) == {}
    real_find_spec = importlib.util.find_spec

    def no_oneccl(name: str, *a: object) -> object:
        return None if name == "oneccl_bindings_for_pytorch" else real_find_spec(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", no_oneccl)
    assert cpu.communication_backend_name() == "gloo"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "oneccl_bindings_for_pytorch" else None
    )
    assert cpu.communication_backend_name() == "ccl"


def test_base_class_delegates_to_torch_device_module() -> None:
    class HostLike(Accelerator):
        name = "hostlike"
        device_type = "cpu"

    acc = HostLike()
    assert acc.device_module() is torch.cpu
    assert acc.device_count() == torch.cpu.device_count()
    assert acc.is_available() is True
    assert acc.device_name(2) == "cpu:2"
    acc.synchronize()
    # torch.cpu has no memory_allocated: the error names what to override
    with pytest.raises(AcceleratorError, match=r"torch.cpu has no memory_allocated\(\); HostLike must override it"):
        acc.memory_allocated()


def test_base_class_unknown_device_type() -> None:
    class Nowhere(Accelerator):
        name = "nowhere"
        device_type = "no_such_device_type"

    with pytest.raises(AcceleratorError, match="no device module for device type 'no_such_device_type'"):
        Nowhere().device_count()


def test_launch_env_of_gpu_accelerators_without_devices() -> None:
    cuda = CudaAccelerator()
    assert cuda.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    assert cuda.export_envs() == ["NCCL"]
    env: dict[str, str] = {}
    cuda.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert cuda.launch_env({"NCCL_DEBUG": "INFO", "PATH": "/bin", "NCCL_IB_DISABLE": "1"}) == {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_DISABLE": "1",
    }
    assert XpuAccelerator().visible_devices_envs() == ["ZE_AFFINITY_MASK"]
    mps = MpsAccelerator()
    assert mps.visible_devices_envs() == [] and mps.is_fp64_supported() is False
    with pytest.raises(AcceleratorError, match="index must be 0"):
        mps.set_device(1)


@pytest.mark.parametrize("name", ["cuda", "xpu", "hpu", "npu", "mps"])
def test_vendor_probe_reports_absence_with_a_reason(name: str) -> None:
    module = importlib.import_module(f"dscore_accelerators.{name}.plugin")
    result = module.probe()
    assert isinstance(result, ProbeResult)
    if result.available:
        pytest.skip(f"{name} is present here: {result.reason}")
    assert result.device_count == 0 and result.reason


def _cuda_available() -> bool:
    from dscore_accelerators.cuda.plugin import probe

    return probe().available


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="no CUDA device here")
def test_cuda_accelerator_on_a_gpu() -> None:
    cuda = CudaAccelerator()
    assert cuda.device_count() >= 1
    cuda.set_device(0)
    assert cuda.current_device() == 0 and cuda.device() == torch.device("cuda", 0)
    x = torch.ones(1024, 1024, device=cuda.device())
    cuda.synchronize()
    assert cuda.memory_allocated() >= x.numel() * 4
    assert cuda.total_memory() >= cuda.available_memory() > 0
    assert cuda.communication_backend_name() == "nccl"

