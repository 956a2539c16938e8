"""The built-in op builders: declarations of sources, includes and flags over ``csrc/``.

Kernel sources are found by :func:`kernel_source_root` (the one place that knows where ``csrc`` is).
Importing this module probes and compiles nothing and does not import torch.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from dscore.errors import OpBuildError
from dscore.ops import CPUOpBuilder, CUDAOpBuilder

__all__ = [
    "kernel_source_root",
    "CPUAdamBuilder",
    "CPUAdagradBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
]

_MARKER = Path("includes") / "dscore_simd.h"


def kernel_source_root() -> Path:
    """Directory holding the kernel sources (``includes/``, ``cpu/``, ``cuda/``).

    Looks in the installed package data (``dscore_plugins/ops/csrc`` via :mod:`importlib.resources`),
    then in the repository's ``csrc/`` (editable installs, source checkouts).

    Raises:
        OpBuildError: neither location holds the sources.
    """
    candidates: list[Path] = []
    try:
        packaged = importlib.resources.files("dscore_plugins.ops") / "csrc"
        candidates.append(Path(str(packaged)))
    except (ModuleNotFoundError, TypeError):
        pass
    candidates.append(Path(__file__).resolve().parents[3] / "csrc")  # <repo>/plugins/dscore_plugins/ops/
    for root in candidates:
        if (root / _MARKER).is_file():
            return root
    raise OpBuildError(
        "the dscore kernel sources (csrc/) were not found in " + ", ".join(str(c) for c in candidates)
        + "; reinstall dscore (they ship as package data of dscore_plugins.ops)"
    )


class _CsrcMixin:
    _SOURCES: tuple[str, ...] = ()

    def sources(self) -> list[Path]:
        root = kernel_source_root()
        return [root / s for s in self._SOURCES]

    def include_dirs(self) -> list[Path]:
        return [kernel_source_root() / "includes"]


class CPUAdamBuilder(_CsrcMixin, CPUOpBuilder):
    """cpu_adam: Adam (Kingma & Ba 2015) / AdamW (Loshchilov & Hutter 2019) on fp32 CPU arrays."""

    NAME = "cpu_adam"
    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    _SOURCES = ("cpu/cpu_adam.cpp",)


class CPUAdagradBuilder(_CsrcMixin, CPUOpBuilder):
    """cpu_adagrad: Adagrad (Duchi et al. 2011) on fp32 CPU arrays."""

    NAME = "cpu_adagrad"
    BUILD_VAR = "DS_BUILD_CPU_ADAGRAD"
    _SOURCES = ("cpu/cpu_adagrad.cpp",)


class CPULionBuilder(_CsrcMixin, CPUOpBuilder):
    """cpu_lion: Lion (Chen et al. 2023) on fp32 CPU arrays."""

    NAME = "cpu_lion"
    BUILD_VAR = "DS_BUILD_CPU_LION"
    _SOURCES = ("cpu/cpu_lion.cpp",)


class FusedAdamBuilder(_CsrcMixin, CUDAOpBuilder):
    """fused_adam: multi-tensor Adam/AdamW on CUDA (fp32/fp16/bf16 params and grads, fp32 states)."""

    NAME = "fused_adam"
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    _SOURCES = ("cuda/fused_adam_kernel.cu", "cuda/fused_adam.cpp")


class FusedLambBuilder(_CsrcMixin, CUDAOpBuilder):
    """fused_lamb: multi-tensor LAMB (You et al. 2020) on CUDA."""

    NAME = "fused_lamb"
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    _SOURCES = ("cuda/fused_lamb_kernel.cu", "cuda/fused_lamb.cpp")


class FusedLionBuilder(_CsrcMixin, CUDAOpBuilder):
    """fused_lion: multi-tensor Lion on CUDA."""

    NAME = "fused_lion"
    BUILD_VAR = "DS_BUILD_FUSED_LION"
    _SOURCES = ("cuda/fused_lion_kernel.cu", "cuda/fused_lion.cpp")
