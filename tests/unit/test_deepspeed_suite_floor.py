"""CI's import-mode check of the DeepSpeed conformance tier (tools/deepspeed_suite.py collect).

Runs DeepSpeed's own ``tests/unit`` in ``--collect-only`` mode against the compat distribution when the snapshot
``../shared/reference/deepspeed-tests`` is laid next to the checkout (skipped with the reason otherwise), into a
temporary folder (the checked-in records and the page stay as they are), and fails when

* fewer files import than ``tools/deepspeed_suite/import_floor.toml`` says (a checked-in count), or
* a file that imports in the checked-in dscore collect record (``tools/deepspeed_suite/records``) no longer does.

Half a minute on two cores, hence ``slow``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

_ROOT = Path(__file__).resolve().parents[2]
_TOOL = _ROOT / "tools" / "deepspeed_suite.py"
_SUITE = _ROOT.parent / "shared" / "reference" / "deepspeed-tests"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("deepspeed_suite_floor_tool", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.slow
@pytest.mark.skipif(not (_SUITE / "tests" / "unit").is_dir(),
                    reason=f"the DeepSpeed test snapshot is not laid at {_SUITE} (../shared/reference absent)")
def test_import_mode_does_not_fall_below_the_floor(suite, tmp_path):
    pytest.importorskip("pytest_forked")
    proc = subprocess.run([sys.executable, str(_TOOL), "collect", "--no-page", "--suite", str(_SUITE),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    suite.SUITE = _SUITE.resolve()
    files = suite.all_files()
    now = suite.read(tmp_path / "dscore-collect.jsonl")
    assert now is not None and now.meta.get("cut") is False, proc.stdout
    importing = len(files) - len(now.collect_errors)
    floor = tomllib.loads((suite.HERE / "import_floor.toml").read_text(encoding="utf-8"))["files_importing"]
    kept = suite.read(suite.RECORDS / "dscore-collect.jsonl")
    regressed = sorted(f for f in now.collect_errors if kept is not None and f not in kept.collect_errors)
    assert not regressed, "files that import in tools/deepspeed_suite/records no longer do:\n" + "\n".join(
        f"{f}: {now.collect_errors[f]}" for f in regressed)
    assert importing >= floor, (
        f"{importing} of {len(files)} DeepSpeed suite files import, below the floor {floor} of "
        f"tools/deepspeed_suite/import_floor.toml; failing now:\n"
        + "\n".join(f"{f}: {m}" for f, m in sorted(now.collect_errors.items())))
