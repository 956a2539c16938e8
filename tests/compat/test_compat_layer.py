"""The ``deepspeed`` compatibility distribution (compat/deepspeed): detection, symbols, edge conversions.

In-process, one rank. The multi-rank runs of the real Trainer / Accelerate are in test_hf_trainer.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import math
import os

# compat/deepspeed is installed by `make setup` (never skipped: a missing layer is a failure)
import deepspeed  # noqa: E402
import pytest
import torch

import dscore
from dscore.config.client_values import convert_client_values
from dscore.errors import ConfigError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _config(**extra: object) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    cfg.update(extra)
    return cfg


def test_detected_as_deepspeed_with_its_version_and_a_dscore_tag() -> None:
    from packaging.version import Version

    assert getattr(deepspeed, "__dscore__", False) is True
    assert importlib.util.find_spec("deepspeed") is not None
    meta = importlib.metadata.metadata("deepspeed")
    assert meta["Name"] == "deepspeed"
    version = Version(importlib.metadata.version("deepspeed"))
    assert version.public == "0.19.8" and version.local is not None and version.local.startswith("dscore")
    assert deepspeed.__version__ == str(version)
    # what the integrations check before they touch deepspeed
    from accelerate.utils import compare_versions, is_deepspeed_available
    from transformers.integrations.deepspeed import is_deepspeed_available as hf_available

    assert hf_available() and is_deepspeed_available()
    for gate in ("0.9.3", "0.14", "0.16.4", "0.18.2"):
        assert compare_versions("deepspeed", ">=", gate)
    from dscore.env_report import collect_report, deepspeed_compat, format_report

    status = deepspeed_compat()
    assert status["active"] and status["version"] == str(version)
    assert "deepspeed (compat) .......... active" in format_report(
        {**{k: {"value": None, "error": "skipped"} for k in ("dscore", "python", "torch", "cxx", "ninja", "nvcc",
                                                              "cpu_simd", "shm", "swap", "accelerator", "ops")},
         "deepspeed_compat": {"value": status}}
    )
    assert "deepspeed_compat" in collect_report.__doc__


def test_every_symbol_the_integrations_import_is_there() -> None:
    import deepspeed.checkpointing
    from deepspeed import comm, zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.utils import logger
    from deepspeed.utils.logging import logger as logger2
    from deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        get_model_state_file,
        get_optim_files,
    )

    from dscore.runtime.engine import DscoreEngine

    assert deepspeed.DeepSpeedEngine is DeepSpeedEngine is DscoreEngine
    assert deepspeed.init_distributed is comm.init_distributed
    assert zero.GatheredParameters is dscore.zero.GatheredParameters and issubclass(zero.Init, dscore.zero.Init)
    assert set(VALID_LR_SCHEDULES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    assert {DeepSpeedCPUAdam.__name__, DeepSpeedCPUAdagrad.__name__, DeepSpeedCPULion.__name__} == {
        "DscoreCPUAdam", "DscoreCPUAdagrad", "DscoreCPULion"}
    assert issubclass(DeepSpeedCPUAdam, DeepSpeedOptimizer)
    assert pp._orig_torch_arange is torch.arange and pp.ZeroParamStatus is dscore.zero.ZeroParamStatus
    assert callable(pp.zero_wrapper_for_fp_tensor_constructor) and pp.get_accelerator is get_accelerator
    assert get_accelerator().device_name(0) == "cpu" and get_accelerator().communication_backend_name() == "gloo"
    assert logger is logger2 and DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert callable(deepspeed.checkpointing.checkpoint) and callable(deepspeed.checkpointing.configure)
    assert callable(get_fp32_state_dict_from_zero_checkpoint) and callable(get_model_state_file)
    assert callable(get_optim_files) and callable(deepspeed.initialize)
    big = torch.arange(10.0)
    view = big[2:4]
    saved = clone_tensors_for_torch_save({"a": [view], "b": 3})
    assert saved["b"] == 3 and saved["a"][0].untyped_storage().nbytes() == 2 * 4
    # a DeepSpeed name whose feature dscore lacks imports, and refuses when used (issue 39: never at import)
    from deepspeed._not_provided import NotProvidedError

    with pytest.raises(NotProvidedError, match="init_inference"):
        deepspeed.init_inference(torch.nn.Linear(2, 2))


def test_the_layer_uses_public_dscore_names_only(repo_root) -> None:
    """A thin skin over the public API (ARCHITECTURE.md §10): no private dscore module or name."""
    from dscore.import_contract import check_paths

    assert check_paths([str(repo_root / "compat" / "deepspeed")]) == []


def test_import_deepspeed_stays_torch_free(python_exe: str) -> None:
    """transformers imports ``deepspeed`` at module level; like ``import dscore`` it must not pull torch."""
    import subprocess

    code = "import sys, deepspeed; print(deepspeed.__version__, 'torch' in sys.modules)"
    out = subprocess.run([python_exe, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "False", out.stdout


def test_console_scripts_are_declared() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.distribution("deepspeed").entry_points
           if ep.group == "console_scripts"}
    assert eps == {"deepspeed": "deepspeed.launcher.runner:cli_main", "ds_report": "deepspeed.env_report:cli_main"}
    import json
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    launcher = subprocess.run([bin_dir / "deepspeed", "--help"], capture_output=True, text=True, timeout=120)
    assert launcher.returncode == 0 and launcher.stdout.startswith("usage: dscore run"), launcher.stderr
    # conflicting flags: one line naming them, exit 2, no traceback (runner.main() raises the ValueError)
    bad = subprocess.run([bin_dir / "deepspeed", "--num_nodes", "1", "-i", "localhost", "x.py"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("deepspeed: error: "), bad.stderr
    assert "Traceback" not in bad.stderr and "include" in bad.stderr, bad.stderr
    report = subprocess.run([bin_dir / "ds_report", "--json"], capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["deepspeed_compat"]["value"]["active"] is True


def test_convert_client_values() -> None:
    data = {"steps_per_print": math.inf, "zero_optimization": {"stage": 2},
            "zero_optimization.reduce_bucket_size": 10, "train_batch_size": 8}
    out, warnings = convert_client_values(data)
    assert out == {"zero_optimization": {"stage": 2}, "train_batch_size": 8}
    assert data["steps_per_print"] == math.inf  # not mutated
    assert len(warnings) == 2 and "zero_optimization: {'reduce_bucket_size': ...}" in warnings[1]
    assert convert_client_values({"steps_per_print": "Infinity"})[0] == {}
    for kept in (-1, 0, 2.5, "10", -math.inf, True):  # left for the strict validation to judge
        assert convert_client_values({"steps_per_print": kept}) == ({"steps_per_print": kept}, [])


def test_accelerate_and_trl_values_accepted_through_compat_only(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config(steps_per_print=float("inf"), **{"zero_optimization.reduce_bucket_size": 100})
    for bad, key in ((_config(steps_per_print=float("inf")), "steps_per_print"),
                     (_config(**{"zero_optimization.reduce_bucket_size": 100}), "zero_optimization.reduce_bucket_size")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            dscore.initialize(model=_model(), config=bad)  # dscore's own strictness is unchanged
    with caplog.at_level(logging.WARNING, logger="dscore.compat"):
        engine, optimizer, _, _ = deepspeed.initialize(model=_model(), config_params=cfg)
    messages = [r.getMessage() for r in caplog.records if r.name == "dscore.compat"]
    assert any("steps_per_print: inf" in m for m in messages)
    assert any("'zero_optimization.reduce_bucket_size'" in m for m in messages)
    assert engine.steps_per_print() is None
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    # engine.config reads as the dict that was passed (Trainer: engine.config.get("zero_optimization", {}))
    assert engine.config.get("optimizer") == cfg["optimizer"] and engine.config.get("missing", 7) == 7
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss, scale_wrt_gas=False)
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    assert engine.global_steps == 1 and engine.get_global_grad_norm() is not None
    engine.close()


def test_warmup_lr_before_a_step_raises_the_assertion_trainer_catches() -> None:
    engine, _, _, sched = deepspeed.initialize(
        model=_model(),
        config=_config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4, "last_batch_iteration": 2}}),
    )
    with pytest.raises(AssertionError, match="need to call step"):
        sched.get_last_lr()
    with pytest.raises(RuntimeError):  # dscore's own contract stays a RuntimeError too
        sched.get_last_lr()
    engine.close()


def test_unsupported_arguments_are_refused_by_name() -> None:
    from dscore.runtime.initialize import InitializeError

    with pytest.raises(InitializeError, match="mesh_param"):
        deepspeed.initialize(model=_model(), config=_config(), mesh_param="1x2")
    with pytest.raises(ConfigError, match="remote_device=\"nvme\""):
        deepspeed.zero.Init(remote_device="nvme", enabled=False)
    with pytest.raises(ConfigError, match="mpu"):
        deepspeed.zero.Init(mpu=object(), enabled=False)
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    with pytest.raises(dscore.errors.CheckpointError, match="'int8'"):
        convert_zero_checkpoint_to_state_dict("/nonexistent", "/nonexistent-out", dtype="int8")


def test_zero_init_takes_its_dtype_from_the_config() -> None:
    from dscore.zero.init import Init

    assert Init(config_dict_or_path={"bf16": {"enabled": True}}, enabled=True).dtype == torch.bfloat16
    assert Init(config_dict_or_path={"fp16": {"enabled": True}}).dtype == torch.float16
    assert Init(config_dict_or_path={"train_batch_size": 2}).dtype == torch.float32
    assert Init().dtype is None  # without a config: each module's own dtype
    with pytest.raises(ConfigError, match="both true"):
        Init(config_dict_or_path={"bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_lightning_deepspeed_strategy_imports_and_configures() -> None:
    """Lightning's DeepSpeedStrategy needs CUDA to run; what runs anywhere is its import, its availability and
    version gates and its config assembly (its checkpoint converter is exercised in test_hf_trainer.py)."""
    from lightning_fabric.strategies.deepspeed import _DEEPSPEED_AVAILABLE, _DEEPSPEED_GREATER_EQUAL_0_16
    from pytorch_lightning.strategies import DeepSpeedStrategy

    assert bool(_DEEPSPEED_AVAILABLE) and bool(_DEEPSPEED_GREATER_EQUAL_0_16)
    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=False)
    assert strategy.config["zero_optimization"]["stage"] == 3


def test_save_in_deepspeed_layout_reads_back_and_refuses_what_it_cannot_write(tmp_path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_optim_files

    engine, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 1}))
    assert engine.checkpoint_layout == "deepspeed"
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    tag_dir = tmp_path / "global_step1"
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in tag_dir.iterdir()) == [
        "_COMPLETE", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert [p.rsplit("/", 1)[1] for p in get_optim_files(str(tag_dir))] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=True)  # plain types only
    assert states["epoch"] == 3 and states["global_steps"] == 1 and states["ds_version"] == "0.19.8"
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    for name, p in engine.module.named_parameters():
        assert torch.equal(fp32[name], p.detach()), name
    # loads back through dscore's safe DeepSpeed reader
    other, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 1}))
    path, client = other.load_checkpoint(str(tmp_path))
    assert path is not None and client == {"epoch": 3} and other.global_steps == 1
    for a, b in zip(engine.module.parameters(), other.module.parameters()):
        assert torch.equal(a, b)
    for e in (engine, other):
        e.close()
    stage0, *_ = deepspeed.initialize(model=_model(), config=_config())
    assert stage0.save_checkpoint(str(tmp_path / "z0"))  # DeepSpeed's stage-0 file: the torch optimizer state
    assert sorted(os.listdir(tmp_path / "z0" / "global_step0")) == ["_COMPLETE", "mp_rank_00_model_states.pt"]
    stage0.close()
    frozen = _model()
    next(frozen.parameters()).requires_grad_(False)
    stage0, *_ = deepspeed.initialize(model=frozen, config=_config())
    with pytest.raises(dscore.errors.CheckpointError, match="ZeRO stage 0 is not supported with frozen parameters"):
        stage0.save_checkpoint(str(tmp_path / "z0f"))
    stage0.checkpoint_layout = "dscore"  # dscore's own format still works
    assert stage0.save_checkpoint(str(tmp_path / "z0f"))
    stage0.close()


def test_z3_leaf_module_helpers_are_dscores_own() -> None:
    """``deepspeed.utils.set_z3_leaf_modules`` & co. are ``dscore.zero``'s (imported when first used); a dscore
    without them is a clear error naming the missing name, never a stand-in."""
    import deepspeed.utils as ds_utils

    for name in ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module"):
        own = getattr(dscore.zero, name, None)
        if own is not None:
            assert getattr(ds_utils, name) is own
        else:
            with pytest.raises(ConfigError, match=f"dscore.zero.{name} is missing"):
                getattr(ds_utils, name)


def test_initialize_forms_the_integrations_use() -> None:
    """``config_params=`` with a client optimizer and a callable ``lr_scheduler`` (Accelerate's DummyScheduler
    path), and an optimizer-less engine (Trainer's ZeRO-3 inference)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    made = []

    def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        made.append(optimizer)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2}}
    engine, eopt, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=make_scheduler,
                                                  config_params=cfg)
    assert made and sched is engine.lr_scheduler and isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert sched.get_last_lr() == [pytest.approx(0.005)]
    engine.close()
    bare, bare_opt, _, bare_sched = deepspeed.initialize(model=_model(), config={"train_micro_batch_size_per_gpu": 1})
    assert bare_opt is None and bare_sched is None
    assert bare(torch.ones(1, 4)).shape == (1, 1)
    bare.close()


def test_zero3_parameters_carry_deepspeeds_status_attributes() -> None:
    """``ds_status`` follows gather/release; ``ds_numel`` and ``partition_numel()`` count elements."""
    from dscore.zero import ZeroParamStatus

    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1}):
        layer = torch.nn.Linear(3, 5)
    w = layer.weight
    assert w.ds_numel == 15 and w.partition_numel() == 15 and layer.bias.partition_numel() == 5
    assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE
    with deepspeed.zero.GatheredParameters(layer.parameters()):
        assert w.ds_status is ZeroParamStatus.AVAILABLE and w.shape == (5, 3)
    assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_deepspeed_layout_in_bf16_at_zero3_and_fp16_refused(tmp_path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = _config(zero_optimization={"stage": 3}, bf16={"enabled": True})
    engine, *_ = deepspeed.initialize(model=_model(), config=cfg)
    engine.backward(engine(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "bf16"))
    masters = engine.zero_stage_impl.state_dict()["fp32_params"]
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "bf16"))
    assert set(fp32) == set(masters)
    for name, value in masters.items():  # the fp32 masters, not the bf16 weights
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], value), name
    engine.close()
    fp16, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 2}, fp16={"enabled": True}))
    with pytest.raises(dscore.errors.CheckpointError, match="not supported with fp16"):
        fp16.save_checkpoint(str(tmp_path / "fp16"))
    assert not (tmp_path / "fp16" / "global_step0").exists()
    fp16.close()
