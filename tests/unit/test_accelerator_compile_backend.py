"""The accelerator's torch.compile backend accessors (DeepSpeed's get/set_compile_backend, issue 41)."""

from __future__ import annotations

import pytest

from dscore.errors import AcceleratorError
from dscore_accelerators.cpu.accelerator import CpuAccelerator


def test_cpu_default_is_inductor_and_set_changes_only_this_instance() -> None:
    acc, other = CpuAccelerator(), CpuAccelerator()
    assert acc.get_compile_backend() == "inductor"
    acc.set_compile_backend("aot_eager")
    assert acc.get_compile_backend() == "aot_eager"
    assert other.get_compile_backend() == "inductor"


def test_set_compile_backend_refuses_an_unknown_name_listing_valid_ones() -> None:
    acc = CpuAccelerator()
    with pytest.raises(AcceleratorError, match=r"set_compile_backend\('nope'\).*valid: .*inductor"):
        acc.set_compile_backend("nope")
    assert acc.get_compile_backend() == "inductor"
