"""The CUDA kernels compile with nvcc (object files; no GPU and no CUDA build of torch needed).

The ``.cu`` files are torch-free (raw pointers + sizes), so ``nvcc -c`` needs only the CUDA headers and
``csrc/includes``. Skipped, with the reason, where no CUDA toolkit is installed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dscore.errors import OpBuildError
from dscore.ops import get_op_builder, toolchain

pytestmark = pytest.mark.slow


def _nvcc_or_skip() -> toolchain.Tool:
    try:
        return toolchain.find_nvcc()
    except OpBuildError as exc:
        pytest.skip(f"no CUDA toolkit here: {exc}")


@pytest.mark.parametrize("name", ["fused_adam", "fused_lamb", "fused_lion"])
def test_cuda_kernels_compile_to_objects(name: str, tmp_path: Path) -> None:
    nvcc = _nvcc_or_skip()
    builder = get_op_builder(name)
    sources = builder.kernel_sources()
    assert sources, f"{name} declares no .cu sources"
    major = int(nvcc.version.split(".")[0])
    arch = [("8.0", True)] if major >= 11 else [("7.0", True)]
    for source in sources:
        out = tmp_path / (source.stem + ".o")
        cmd = builder.object_compile_command(source, out, arch_list=arch)
        assert any(f"-I{p}" in cmd for p in builder.include_dirs())
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
        assert out.is_file() and out.stat().st_size > 0
        symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True, check=False).stdout
        if symbols:
            assert f"dscore::{name}_cuda" in symbols, f"{name}_cuda is not defined in {out}"
