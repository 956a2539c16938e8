"""``deepspeed.git_version_info``: version, build and torch facts DeepSpeed writes at install time, here read
from the running installation.

``version`` / ``git_hash`` / ``git_branch`` are the package's; ``installed_ops`` maps every op to False (dscore
ships no prebuilt op: each is built into dscore's cache on first ``load()``); ``compatible_ops`` is
``deepspeed.ops.__compatible_ops__`` (asked on first access); ``accelerator_name`` and ``torch_info`` (torch
``version`` as ``"major.minor"``, ``bf16_support``, ``cuda_version`` / ``nccl_version`` / ``hip_version``,
``"0.0"`` where torch has none: DeepSpeed's sentinel) describe this process, not an install-time snapshot.
"""

from __future__ import annotations

from typing import Any

import torch

import deepspeed

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]  # noqa: F822 - resolved on first access by __getattr__

version = deepspeed.__version__
git_hash = deepspeed.__git_hash__
git_branch = deepspeed.__git_branch__


def _major_minor(text: str | None) -> str:
    if not text:
        return "0.0"
    parts = text.split("+")[0].split(".")
    return ".".join((parts + ["0"])[:2])


def _nccl() -> str:
    if torch.version.cuda is None or not torch.distributed.is_nccl_available():
        return "0.0"
    major, minor, *_ = torch.cuda.nccl.version()
    return f"{major}.{minor}"


def __getattr__(name: str) -> Any:
    if name == "installed_ops":
        from deepspeed.ops.op_builder import ALL_OPS

        value: Any = dict.fromkeys(ALL_OPS, False)
    elif name == "compatible_ops":
        import deepspeed.ops

        value = deepspeed.ops.__compatible_ops__
    elif name in ("accelerator_name", "torch_info"):
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        globals()["accelerator_name"] = accel._name
        globals()["torch_info"] = {"version": _major_minor(torch.__version__),
                                   "bf16_support": bool(accel.is_bf16_supported()),
                                   "cuda_version": _major_minor(torch.version.cuda), "nccl_version": _nccl(),
                                   "hip_version": _major_minor(getattr(torch.version, "hip", None))}
        return globals()[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
