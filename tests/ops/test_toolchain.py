"""Fast tests of the build machinery: toolchain probes, cache keys, locks, errors before ninja runs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dscore.errors import ComponentNotFoundError, OpBuildError
from dscore.ops import OpBuilder, get_op_builder, toolchain
from dscore.ops.builder import build_lock, cache_root


def _fail_if_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("torch.utils.cpp_extension.load must not be reached")


# ---------------------------------------------------------------- arch lists and CUDA versions
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("8.0;8.6;9.0", [("8.0", False), ("8.6", False), ("9.0", False)]),
        ("8.0 8.6  9.0+PTX", [("8.0", False), ("8.6", False), ("9.0", True)]),
        (" 7.5; 9.0a+PTX ;7.5", [("7.5", False), ("9.0a", True)]),
        ("10.0,12.0", [("10.0", False), ("12.0", False)]),
    ],
)
def test_parse_cuda_arch_list(value: str, expected: list[tuple[str, bool]]) -> None:
    assert toolchain.parse_cuda_arch_list(value) == expected


@pytest.mark.parametrize("value", ["sm_80", "8", "8.0+ptx+PTX", ";;", "Ampere"])
def test_parse_cuda_arch_list_rejects(value: str) -> None:
    with pytest.raises(OpBuildError, match="TORCH_CUDA_ARCH_LIST"):
        toolchain.parse_cuda_arch_list(value)


def test_gencode_flags() -> None:
    flags = toolchain.cuda_arch_gencode_flags([("8.0", False), ("9.0", True)])
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_cuda_arch_list_from_env_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = get_op_builder("fused_adam")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert builder.arch_list() == [("8.0", False), ("9.0", True)]


def test_cuda_major_mismatch_is_an_error_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK", raising=False)
    with pytest.raises(OpBuildError) as info:
        toolchain.check_cuda_versions("13.0", "12.4")
    assert "13.0" in str(info.value) and "12.4" in str(info.value) and "DS_SKIP_CUDA_CHECK=1" in str(info.value)
    toolchain.check_cuda_versions("12.8", "12.4")  # same major: fine


def test_cuda_mismatch_downgraded_by_skip_check(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")
    with caplog.at_level(logging.WARNING, logger="dscore.ops"):
        toolchain.check_cuda_versions("13.0", "12.4")
    assert any("mismatch" in r.message and r.levelno == logging.WARNING for r in caplog.records)


def test_cpu_only_torch_is_not_cuda_compatible() -> None:
    with pytest.raises(OpBuildError, match="no CUDA support"):
        toolchain.check_cuda_versions("13.0", None)


# ---------------------------------------------------------------- missing toolchain: errors before ninja
def test_missing_compiler_is_a_clear_error_before_ninja(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++")
    monkeypatch.setattr(cpp_extension, "load", _fail_if_called)
    with pytest.raises(OpBuildError, match=r"CXX='/nonexistent/bin/g\+\+'"):
        get_op_builder("cpu_adam").load()
    assert not any(tmp_path.rglob("*.so"))


def test_missing_cuda_home_is_a_clear_error_before_ninja(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setattr(cpp_extension, "load", _fail_if_called)
    builder = get_op_builder("fused_lamb")
    ok, reason = builder.compatibility()
    assert not ok and "no-cuda" in reason and "nvcc" in reason
    with pytest.raises(OpBuildError, match="cannot be built here"):
        builder.load()


def test_nvcc_found_only_with_headers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A wrapper script called nvcc in some bin/ does not make its parent a CUDA toolkit."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.1, V99.1.0'\n")
    (fake_bin / "nvcc").chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}/usr/bin:/bin")
    try:
        home, origin = toolchain.find_cuda_home()
    except OpBuildError:
        return  # no real toolkit on this machine either: also correct
    assert home != tmp_path and origin != "nvcc on PATH"


def test_ninja_from_python_package_when_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no ninja on PATH
    tool = toolchain.find_ninja()
    assert tool.origin == "python ninja package" and tool.version


def test_no_ninja_at_all_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ninja

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ninja, "BIN_DIR", str(tmp_path / "none"))
    with pytest.raises(OpBuildError, match="pip install ninja"):
        toolchain.find_ninja()


def test_simd_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCORE_CPU_SIMD", "scalar")
    assert toolchain.cpu_simd_level() == "scalar"
    monkeypatch.setenv("DSCORE_CPU_SIMD", "sse9")
    with pytest.raises(OpBuildError, match="DSCORE_CPU_SIMD"):
        toolchain.cpu_simd_level()


# ---------------------------------------------------------------- cache keys
def test_cache_root_honours_torch_extensions_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cache_root() == tmp_path / "dscore"
    plan = get_op_builder("cpu_adam").plan()
    assert plan.directory.parent == tmp_path / "dscore"
    import torch

    name = plan.directory.name
    assert name.startswith("cpu_adam-cpu-torch") and torch.__version__.split("+")[0] in name


def test_cache_key_separates_toolchains_and_is_stable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Different ninja/compiler versions get different directories; the same environment the same one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = get_op_builder("cpu_adam")
    first, again = builder.plan(), builder.plan()
    assert first.directory == again.directory and first.module_name == again.module_name
    real_ninja, real_cxx = toolchain.find_ninja(), toolchain.find_cxx()
    monkeypatch.setattr(toolchain, "find_ninja", lambda environ=None: toolchain.Tool(real_ninja.path, "1.10.0", "PATH"))
    other_ninja = builder.plan().directory
    monkeypatch.setattr(toolchain, "find_cxx", lambda environ=None: toolchain.Tool(real_cxx.path, "g++ 11.4", "CXX"))
    other_both = builder.plan().directory
    assert len({first.directory, other_ninja, other_both}) == 3
    monkeypatch.setenv("DSCORE_CPU_SIMD", "scalar")
    assert builder.plan().directory != other_both  # SIMD flags are part of the key


# ---------------------------------------------------------------- locks
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dscore.ops.builder import build_lock
    with build_lock(Path(sys.argv[1])):
        print("locked", flush=True)
        time.sleep(120)
    """
)


def _start_holder(lock: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_live_lock_is_waited_for_with_timeout(tmp_path: Path) -> None:
    lock = tmp_path / "op.lock"
    holder = _start_holder(lock)
    try:
        start = time.monotonic()
        with pytest.raises(OpBuildError, match=rf"timed out .* pid {holder.pid}"):
            with build_lock(lock, timeout_s=1.0, poll_s=0.05):
                pass
        assert time.monotonic() - start >= 1.0
    finally:
        holder.kill()
        holder.wait()


def test_lock_released_by_finished_owner_is_acquired(tmp_path: Path) -> None:
    lock = tmp_path / "op.lock"
    holder = _start_holder(lock)
    holder.kill()  # SIGKILL: the kernel drops the flock, the owner record stays in the file
    holder.wait()
    with build_lock(lock, timeout_s=5.0):
        assert str(os.getpid()) in lock.read_text()


def test_stale_lock_of_killed_build_is_removed_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lock = tmp_path / "op.lock"
    holder = _start_holder(lock)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="dscore.ops"):
        with build_lock(lock, timeout_s=5.0):
            pass
    assert any("stale build lock" in r.message and str(holder.pid) in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- registry lookups
def test_get_op_builder_returns_instances() -> None:
    for name in ("cpu_adam", "cpu_adagrad", "cpu_lion", "fused_adam", "fused_lamb", "fused_lion"):
        builder = get_op_builder(name)
        assert isinstance(builder, OpBuilder) and builder.NAME == name
        assert all(Path(s).is_file() for s in builder.sources())
    assert get_op_builder("CPU_ADAM").NAME == "cpu_adam"


def test_get_op_builder_miss_raises() -> None:
    with pytest.raises(ComponentNotFoundError) as info:
        get_op_builder("cpu_adma")
    assert "cpu_adam" in str(info.value)


def test_manifest_specs() -> None:
    from dscore_plugins.ops import plugin

    ops = {s.name: s for s in plugin.dscore_register_op_builders()}
    assert set(ops) == {
        "cpu_adam", "cpu_adagrad", "cpu_lion", "fused_adam", "fused_lamb", "fused_lion", "async_io",
    }
    assert ops["async_io"].build_env_var == "DS_BUILD_AIO"
    # shm_sync is one unit with the shm transport: the comm plugin registers it
    from dscore_plugins.comm import plugin as comm_plugin

    comm_ops = {s.name: s for s in comm_plugin.dscore_register_op_builders()}
    assert set(comm_ops) == {"shm_sync"}
    assert comm_ops["shm_sync"].build_env_var == "DS_BUILD_SHM_SYNC" and comm_ops["shm_sync"].device_types == ("cpu",)
    assert ops["cpu_adam"].build_env_var == "DS_BUILD_CPU_ADAM" and ops["cpu_adam"].device_types == ("cpu",)
    assert ops["fused_lion"].device_types == ("cuda",)
    optims = {s.name: s for s in plugin.dscore_register_optimizers()}
    assert all(optims[n].offload_capable for n in ("DscoreCPUAdam", "DscoreCPUAdagrad", "DscoreCPULion"))
    assert "cpu_adam" in optims["DscoreCPUAdam"].aliases


def test_kernel_sources_resolve() -> None:
    from dscore_plugins.ops.builders import kernel_source_root

    root = kernel_source_root()
    assert (root / "includes" / "dscore_simd.h").is_file() and (root / "cuda" / "fused_adam_kernel.cu").is_file()
