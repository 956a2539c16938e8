"""DeepSpeed 0.19.8 names the DeepSpeed unit suite imports first (issue 39): ``deepspeed.accelerator``'s full
object API, ``deepspeed.ops.op_builder``, ``deepspeed.utils.torch``, ``deepspeed.compile`` and the
not-provided stand-ins. In-process, one rank; behaviour checked against dscore's own answers."""

from __future__ import annotations

import deepspeed  # noqa: F401 - compat/deepspeed, installed by `make setup`
import pytest
import torch

from dscore.errors import AcceleratorError


@pytest.fixture
def accel():
    from deepspeed.accelerator import get_accelerator, set_accelerator

    set_accelerator(None)
    yield get_accelerator()
    set_accelerator(None)


def test_accelerator_maps_dscore_and_adds_deepspeed_api(accel, monkeypatch):
    from deepspeed.accelerator import DeepSpeedAccelerator, get_accelerator, is_current_accelerator_supported

    assert isinstance(accel, DeepSpeedAccelerator) and get_accelerator() is accel  # one object per accelerator
    inner = accel.dscore_accelerator
    assert accel._name == inner.name == "cpu"
    assert accel.device_name() == inner.device_name() and accel.current_device_name() == "cpu"
    assert accel.communication_backend_name() == inner.communication_backend_name()
    assert accel.is_bf16_supported() is inner.is_bf16_supported()
    assert is_current_accelerator_supported()
    # DeepSpeed's CPU convention: LOCAL_SIZE is the device count when set
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert accel.device_count() == inner.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert accel.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "two")
    with pytest.raises(AcceleratorError, match="LOCAL_SIZE='two'"):
        accel.device_count()
    # traits of a synchronous device, memory stats under DeepSpeed's keys, typed constructors on the device
    assert accel.use_host_timers() and accel.resolves_data_dependency() and accel.handles_memory_backpressure()
    stats = accel.memory_stats()
    assert stats["allocated_bytes.all.current"] > 0
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    t = accel.FloatTensor([1, 2, 3])
    assert t.dtype == torch.float32 and t.device.type == "cpu" and t.tolist() == [1.0, 2.0, 3.0]
    assert accel.LongTensor(2, 3).shape == (2, 3) and accel.LongTensor(2, 3).dtype == torch.int64
    assert accel.random() is torch.random and accel.default_generator(0) is torch.default_generator
    assert accel.create_graph() is None and accel.default_stream() is None and accel.lazy_call(lambda: 7) == 7
    assert accel.is_triton_supported() is False and accel.is_current_stream_capturing() is False


def test_accelerator_op_builders_and_compile_backend(accel):
    from deepspeed.ops.op_builder import CPUAdamBuilder

    assert accel.op_builder_dir() == "deepspeed.ops.op_builder"
    assert accel.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder
    assert isinstance(accel.create_op_builder("CPUAdamBuilder"), CPUAdamBuilder)
    assert accel.get_op_builder("NoSuchBuilder") is None and accel.create_op_builder("NoSuchBuilder") is None
    assert accel.get_compile_backend() == "inductor"
    with pytest.raises(ValueError, match="not_a_backend not supported"):
        accel.set_compile_backend("not_a_backend")
    accel.set_compile_backend("eager")
    assert accel.get_compile_backend() == "eager"


def test_set_accelerator_validates_and_overrides(accel):
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    with pytest.raises(AcceleratorError, match="expected a deepspeed.accelerator.abstract_accelerator"):
        set_accelerator(object())
    mine = CPU_Accelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine and mine is not accel
    set_accelerator(None)
    assert get_accelerator() is accel


def test_op_builders_answer_through_dscore_registry():
    import deepspeed.ops
    from deepspeed._not_provided import NotProvidedError
    from deepspeed.ops.op_builder import ALL_OPS, CPUAdamBuilder, FusedAdamBuilder, InferenceBuilder

    from dscore.ops import get_op_builder

    assert (CPUAdamBuilder.NAME, CPUAdamBuilder.BUILD_VAR) == ("cpu_adam", "DS_BUILD_CPU_ADAM")
    ours = get_op_builder("cpu_adam")
    assert CPUAdamBuilder().is_compatible() is ours.compatibility()[0]
    assert CPUAdamBuilder().sources() == [str(p) for p in ours.sources()]
    assert FusedAdamBuilder().is_compatible() is get_op_builder("fused_adam").compatibility()[0]
    # an op dscore does not have: not compatible (with the reason kept), refused when loaded
    inference = InferenceBuilder()
    assert inference.is_compatible() is False and "transformer_inference" in inference.error_log
    with pytest.raises(NotProvidedError, match="InferenceBuilder .* is not provided by dscore"):
        inference.load()
    compatible = deepspeed.ops.__compatible_ops__
    assert set(compatible) == set(ALL_OPS) and compatible["cpu_adam"] is CPUAdamBuilder().is_compatible()
    assert compatible["transformer_inference"] is False


def test_required_torch_version(monkeypatch):
    from deepspeed.utils.torch import register_grad_hook, required_torch_version

    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    assert required_torch_version(min_version=2.5) and required_torch_version(min_version="2.5.1")
    assert not required_torch_version(min_version=2.6)
    assert not required_torch_version(max_version=2.4)
    assert required_torch_version(min_version=2.0, max_version="2.5.1")
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()
    monkeypatch.undo()
    # the hook runs once the gradient has been accumulated into .grad
    p = torch.nn.Parameter(torch.ones(3, device="cpu"))
    seen = []
    register_grad_hook(p, lambda param: seen.append(param.grad.clone()))
    (p * 2).sum().backward()
    assert len(seen) == 1 and seen[0].tolist() == [2.0, 2.0, 2.0]


def test_deepcompile_layout_imports_and_refuses_on_use():
    from deepspeed._not_provided import NotProvidedError
    from deepspeed.compile import backend
    from deepspeed.compile.passes import prefetch
    from deepspeed.compile.util import get_deepcompile_handle, is_deepcompile_supported

    assert is_deepcompile_supported() is False
    with pytest.raises(NotProvidedError, match=r"deepspeed\.compile\.util\.get_deepcompile_handle .* DeepCompile"):
        get_deepcompile_handle()
    stand_in = backend.make_backend
    with pytest.raises(NotProvidedError, match="deepspeed.compile.backend.make_backend"):
        stand_in(None)
    assert backend.make_backend is stand_in  # kept in the module after the first read

    class Sub(prefetch.PrefetchPass):  # subclassing at import time works; building one is refused
        pass

    with pytest.raises(NotProvidedError):
        Sub()
    with pytest.raises(AttributeError):
        backend.__wrapped__  # noqa: B018 - dunders stay real AttributeErrors (copy/pickle/inspect probe them)


def test_git_version_info_describes_this_process():
    from deepspeed.git_version_info import accelerator_name, installed_ops, torch_info
    from deepspeed.ops.op_builder import ALL_OPS

    major, minor = torch.__version__.split(".")[:2]
    assert torch_info["version"] == f"{major}.{minor}"
    assert torch_info["cuda_version"] == ("0.0" if torch.version.cuda is None else ".".join(torch.version.cuda.split(".")[:2]))
    assert accelerator_name == "cpu" and installed_ops == dict.fromkeys(ALL_OPS, False)
