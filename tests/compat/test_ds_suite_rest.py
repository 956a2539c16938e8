"""Issue 39, the remaining import blockers of DeepSpeed's suite: refused subtrees, runtime.utils/config,
lr_schedules constants and classes, utils.nvtx, and the report mode's run records."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


def test_refused_subtrees_import_and_refuse_on_use_only_with_deepspeeds_layout():
    from deepspeed._not_provided import NotProvidedError

    mod = importlib.import_module("deepspeed.ops.transformer.inference.triton.matmul_ext")
    fn = mod.fp16_matmul  # importing and reading the name works ...
    with pytest.raises(NotProvidedError, match=r"matmul_ext\.fp16_matmul \(DeepSpeed 0\.19\.8\).*fused transformer"):
        fn(torch.zeros(1, device="cpu"))  # ... using it is refused with the reason
    from deepspeed.inference.v2.ragged import DSStateManager
    with pytest.raises(NotProvidedError, match="no inference engine"):
        DSStateManager()
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    with pytest.raises(NotProvidedError, match="`bf16` config block"):
        BF16_Optimizer(None)
    with pytest.raises(ModuleNotFoundError):  # not a module of 0.19.8: still missing
        importlib.import_module("deepspeed.inference.no_such_module")
    import deepspeed
    with pytest.raises(NotProvidedError, match=r"deepspeed\.OnDevice"):
        deepspeed.OnDevice(dtype=torch.float32, device="meta")
    from deepspeed.accelerator import get_accelerator
    assert deepspeed.get_accelerator() is get_accelerator()
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.ops.op_builder import AsyncIOBuilder as Builder
    assert AsyncIOBuilder is Builder


def test_runtime_utils_functions_have_deepspeeds_results(capsys):
    import deepspeed.runtime.utils as ds_utils
    from deepspeed._not_provided import NotProvidedError

    assert ds_utils.partition_uniform(num_items=10, num_parts=3) == [0, 4, 7, 10]
    assert ds_utils.partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    parts = ds_utils.partition_balanced([1, 1, 1, 1, 4], 2)
    assert parts == [0, 4, 5]
    assert ds_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert ds_utils.get_global_norm([3.0, 4.0]) == 5.0
    assert ds_utils.get_global_norm([1.0, float("nan")]) == float("inf")
    assert ds_utils.call_to_str("f", 1, "a", key=2) == "f(1, 'a', key=2)"
    t = torch.zeros(2, device="cpu")
    moved = ds_utils.move_to_device({"a": [t], "b": (t, 3)}, "cpu", lambda x: torch.is_tensor(x))
    assert moved["a"][0] is t and isinstance(moved["b"], tuple) and moved["b"][1] == 3
    ds_utils.see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    ds_utils.see_memory_usage("loud", force=True)
    out = capsys.readouterr().out
    assert out.startswith("loud\nMA ") and "CPU Virtual Memory" in out
    with pytest.raises(NotProvidedError, match="clip_grad_norm_"):
        ds_utils.clip_grad_norm_([], max_norm=1.0)


def test_deepspeed_config_reads_dscores_resolved_config(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig, get_gradient_clipping

    from dscore.errors import ConfigError

    raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2}}
    cfg = DeepSpeedConfig(raw)
    assert (cfg.world_size, cfg.train_batch_size, cfg.gradient_accumulation_steps) == (1, 8, 4)
    assert cfg.zero_optimization_stage == 2 and cfg.zero_enabled and cfg.zero_config.stage == 2
    assert (cfg.fp16_enabled, cfg.bfloat16_enabled) == (False, True)
    assert raw == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                   "zero_optimization": {"stage": 2}}  # the caller's dict is not modified
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}), encoding="utf-8")
    assert DeepSpeedConfig(str(path)).train_batch_size == 3

    class Mpu:
        def get_data_parallel_world_size(self):
            return 2

    assert DeepSpeedConfig(raw, mpu=Mpu()).world_size == 1  # no process group: 1, as DeepSpeed
    with pytest.raises(AttributeError, match="dscore_config"):
        _ = cfg.elasticity_enabled
    with pytest.raises(ConfigError):
        DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3})
    assert get_gradient_clipping({}) == 1.0 and get_gradient_clipping({"gradient_clipping": 0.5}) == 0.5


def test_lr_schedules_constants_and_classes_are_dscores():
    from deepspeed.runtime import lr_schedules as ls

    assert (ls.LR_RANGE_TEST, ls.WARMUP_LR, ls.WARMUP_MIN_LR, ls.TOTAL_NUM_STEPS, ls.WARMUP_LOG_RATE) == (
        "LRRangeTest", "WarmupLR", "warmup_min_lr", "total_num_steps", "log")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cpu"))], lr=0.1)
    sched = ls.WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=ls.WARMUP_LINEAR_RATE)
    sched.step()
    assert type(sched).__module__.startswith("dscore_plugins.sched") and opt.param_groups[0]["lr"] == pytest.approx(0.0)


def test_nvtx_decorator_pushes_and_pops_even_on_error(monkeypatch):
    import deepspeed.utils.nvtx as nvtx

    calls = []

    class Acc:
        supports_nvtx_domain = True

        def range_push(self, msg, domain=None):
            calls.append(("push", msg, domain))

        def range_pop(self, domain=None):
            calls.append(("pop", domain))

    monkeypatch.setattr(nvtx, "get_accelerator", lambda: Acc())

    def boom():
        raise ValueError("x")

    with pytest.raises(ValueError):
        nvtx.instrument_w_nvtx(boom)()
    assert calls == [("push", "test_nvtx_decorator_pushes_and_pops_even_on_error.<locals>.boom", "DeepSpeed"),
                     ("pop", "DeepSpeed")]
    monkeypatch.setattr(nvtx, "enable_nvtx", False)
    assert nvtx.instrument_w_nvtx(lambda: 7)() == 7 and len(calls) == 2
    from deepspeed.compile.init_tp import AUTOTP_MIN_TORCH_VERSION
    assert AUTOTP_MIN_TORCH_VERSION == 2.6
    from deepspeed.runtime.zero.linear import zero3_linear_wrap as wrap
    from deepspeed.runtime.zero.partition_parameters import zero3_linear_wrap
    assert zero3_linear_wrap is wrap


def test_report_page_keeps_the_run_records_marked_with_date_and_commit(tmp_path):
    spec = importlib.util.spec_from_file_location("ds_suite_rest_tool", _ROOT / "tools" / "deepspeed_suite.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    try:
        spec.loader.exec_module(tool)
        suite = tmp_path / "suite" / "tests" / "unit"
        (suite / "a").mkdir(parents=True)
        for name in ("test_x.py", "test_y.py"):
            (suite / "a" / name).write_text("", encoding="utf-8")
        tool.SUITE = tmp_path / "suite"
        tool.RECORDS = tmp_path / "records"
        tool.BASELINE = tmp_path / "baseline"
        tool.OUT_DIR = tmp_path / "out"
        tool.RECORDS.mkdir()

        def write(name, events):
            (tool.RECORDS / name).write_text("\n".join(json.dumps(e) for e in events) + "\n", encoding="utf-8")

        write("dscore-collect.jsonl", [
            {"kind": "collect_error", "file": "unit/a/test_y.py", "message": "No module named 'deepspeed.q'"},
            {"kind": "item", "nodeid": "unit/a/test_x.py::t", "sequential": False},
            {"kind": "meta", "side": "dscore", "mode": "collect", "commit": "bbbbbbbbbbbb", "date": "2026-12-03T00:00:00Z",
             "wall_s": 1.0}])
        write("dscore-run.jsonl", [
            {"kind": "report", "nodeid": "unit/a/test_x.py::t", "when": "call", "outcome": "passed", "message": ""},
            {"kind": "meta", "side": "dscore", "mode": "run", "commit": "aaaaaaaaaaaa", "date": "2026-12-01T00:00:00Z",
             "wall_s": 9.0, "cut": False, "timeout_s": 5}])
        page = tool.render(tool.load_reasons())
    finally:
        sys.modules.pop(spec.name, None)
    assert "1 of 2 files import" in page and "2026-12-03T00:00:00Z, commit bbbbbbbbbbbb" in page
    run_line = next(line for line in page.splitlines() if line.startswith("* dscore: 1 passed"))
    assert "2026-12-01T00:00:00Z, commit aaaaaaaaaaaa" in run_line and "**stale**" in run_line


def test_refused_finder_is_installed_once_and_last():
    code = ("import sys, deepspeed, importlib; importlib.reload(deepspeed); from deepspeed._refused_tree import "
            "RefusedTreeFinder as F; fs=[f for f in sys.meta_path if isinstance(f, F)]; "
            "print(len(fs), sys.meta_path[-1] is fs[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "True"]


def test_swap_tensor_constant_and_leaf_module_helpers_by_name_and_suffix():
    from deepspeed._not_provided import NotProvidedError
    from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    from deepspeed.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, z3_leaf_module

    assert MIN_SWAPPABLE_BYTES == 1024**2  # DeepSpeed 0.19.8's value
    with pytest.raises(NotProvidedError, match="swapper classes"):
        PartitionedParamStatus()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    found, missing = set_z3_leaf_modules_by_name(model, ["1", "nope"], raise_if_not_found=False)
    assert found == [model[1]] and missing == ["nope"] and z3_leaf_module(model[1])
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    found, missing = set_z3_leaf_modules_by_suffix(model, ["1.0"])
    assert found == [model[1][0]] and missing == []
