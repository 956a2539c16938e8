"""tools/deepspeed_suite.py: the conformance tier's reading of import errors and its failure classes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "deepspeed_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("deepspeed_suite_tool", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_missing_name_and_classes_from_checked_in_reasons(suite):
    assert suite.missing_name("ModuleNotFoundError: No module named 'deepspeed.pipe'") == "deepspeed.pipe"
    msg = "ImportError: cannot import name 'FusedAdam' from 'deepspeed.ops.adam' (/x/adam.py)"
    assert suite.missing_name(msg) == "deepspeed.ops.adam.FusedAdam"
    reasons = suite.load_reasons()
    assert suite.classify("unit/a.py", msg, reasons) == (
        "dscore defect", "name missing from the compat distribution: `deepspeed.ops.adam.FusedAdam`")
    refused = "NotProvidedError: deepspeed.compile.util.get_deepcompile_handle (DeepSpeed 0.19.8) is not provided by dscore: x"
    assert suite.classify("unit/b.py::t", refused, reasons)[0] == "deliberate difference"
    assert suite.classify("unit/c.py::t", "AssertionError: 3 != 4", reasons) == ("unclassified", "AssertionError: 3 != 4")
    assert suite.area_of("unit/runtime/zero/test_x.py::T::t") == "runtime" and suite.area_of("unit/test_y.py") == "(unit)"


def test_bad_reason_rows_are_refused_naming_the_row(suite, tmp_path):
    bad = tmp_path / "reasons.toml"
    bad.write_text('[[reason]]\npattern = "x"\nclass = "maybe"\nreason = "r"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"#1: class 'maybe' is not one of"):
        suite.load_reasons(bad)
    bad.write_text('[[reason]]\npattern = "("\nclass = "dscore defect"\nreason = "r"\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad pattern"):
        suite.load_reasons(bad)
