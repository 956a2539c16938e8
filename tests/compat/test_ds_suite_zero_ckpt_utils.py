"""Issue 39: DeepSpeed 0.19.8's ``checkpoint``, ``runtime.zero``, ``ops`` and ``utils`` names on dscore, by behaviour."""

from __future__ import annotations

import logging

import deepspeed
import pytest
import torch
from deepspeed._not_provided import NotProvidedError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _config(**extra: object) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    cfg.update(extra)
    return cfg


def test_checkpoint_file_names_are_the_ones_dscore_writes_in_the_deepspeed_layout(tmp_path) -> None:
    from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO, get_model_ckpt_name_for_rank
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SHAPES
    from deepspeed.checkpoint.utils import get_layer_ckpt_name_for_rank, get_zero_ckpt_name_for_rank

    engine, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 1}))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    tag_dir = tmp_path / "global_step1"
    model_file = get_model_ckpt_name_for_rank(str(tag_dir), "00")
    optim_file = get_zero_ckpt_name_for_rank(str(tag_dir), 0, 0)
    assert sorted(p.name for p in tag_dir.iterdir() if p.name != "_COMPLETE") == sorted(
        [model_file.rsplit("/", 1)[1], optim_file.rsplit("/", 1)[1]])
    states = torch.load(model_file, weights_only=True)
    assert set(states[PARAM_SHAPES][0]) == {name for name, _ in engine.module.named_parameters()}
    assert OPTIMIZER_STATE_DICT in torch.load(optim_file, weights_only=True)
    assert UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"
    assert get_layer_ckpt_name_for_rank("d", "layer_01", 1) == "d/layer_01-model_01_model_states.pt"


def test_universal_conversion_and_reshaping_import_and_refuse_when_used() -> None:
    from deepspeed.checkpoint import DeepSpeedCheckpoint
    from deepspeed.checkpoint.autoep_universal import validate_folding_metadata
    from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

    for name in (DeepSpeedCheckpoint, convert_to_universal, validate_folding_metadata):
        with pytest.raises(NotProvidedError, match="load_checkpoint"):
            name("ckpt")


def test_offload_states_takes_the_deepspeed_enums_as_openrlhf_passes_them() -> None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    engine, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 2}))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                          device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    assert engine._state_offloader.offloaded >= {"optim_states", "hp_params"}
    engine.reload_states()
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()


def test_zero_config_is_dscores_model_with_deepspeeds_fields_and_aliases() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum

    cfg = DeepSpeedZeroConfig(**{"stage": 3, "stage3_param_persistence_threshold": 7,
                                 "offload_optimizer": {"device": "CPU"}})
    assert cfg.stage == ZeroStageEnum.weights and cfg.param_persistence_threshold == 7 and cfg.overlap_comm
    assert isinstance(cfg.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu and cfg.offload_param is None
    with pytest.raises(ValueError):
        DeepSpeedZeroConfig(stage=4)


def test_zero_estimators_give_deepspeeds_bytes(capsys) -> None:
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_live,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    # numbers measured with DeepSpeed 0.19.8 (10**9 params, 10**7 largest layer, 2 nodes x 8 GPUs)
    assert estimate_zero3_model_states_mem_needs(10**9, 10**7, 8, 2, True, True, True) == (13500000000, 40000000, 40000000)
    assert estimate_zero3_model_states_mem_needs(10**9, 10**7, 8, 2, True, False, False) == (48000000000, 165000000, 40000000)
    assert estimate_zero3_model_states_mem_needs(10**9, 10**7, 8, 2, False, False, True) == (480000000, 1165000000, 40000000)
    assert estimate_zero2_model_states_mem_needs(10**9, 4, 2, False) == (24000000000, 4250000000)
    rows = estimate_zero3_model_states_mem_needs_all_live(_model(), num_gpus_per_node=2)
    assert len(rows) == 6 and "largest layer params" in capsys.readouterr().out


def test_zero3_linear_matches_torch_linear_in_values_and_gradients() -> None:
    from deepspeed.runtime.zero.linear import LinearModuleForZeroStage3

    torch.manual_seed(0)
    ours = LinearModuleForZeroStage3(4, 3)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 4, device="cpu", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ours(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    for a, b in ((ours.weight.grad, ref.weight.grad), (ours.bias.grad, ref.bias.grad), (x.grad, x_ref.grad)):
        torch.testing.assert_close(a, b)


def test_fused_and_cpu_optimizers_are_dscores_registered_ones() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: F401 - the builder the suite checks first

    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import resolve

    registry = Registry(create_plugin_manager())
    for name, cls in (("FusedAdam", FusedAdam), ("FusedLamb", FusedLamb), ("FusedLion", FusedLion),
                      ("DeepSpeedCPUAdam", DeepSpeedCPUAdam), ("DeepSpeedCPULion", DeepSpeedCPULion)):
        assert cls is resolve(registry.get("optimizer", name).classes[0])
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="CUDA"):
            FusedAdam([torch.nn.Parameter(torch.ones(3, device="cpu"))], lr=1e-3)


def test_utils_repeating_loader_log_level_and_accessors() -> None:
    from deepspeed.utils import RepeatingLoader, logger, safe_get_full_grad, set_log_level_from_string
    from deepspeed.utils.numa import parse_range_list

    loader = RepeatingLoader(torch.utils.data.DataLoader(list(range(3)), batch_size=2))
    assert [b.tolist() for b in (next(loader) for _ in range(4))] == [[0, 1], [2], [0, 1], [2]]
    old = logger.level
    try:
        set_log_level_from_string("ERROR")
        assert logger.level == logging.ERROR
        with pytest.raises(ValueError, match="valid logging levels"):
            set_log_level_from_string("loud")
    finally:
        logger.setLevel(old)
    assert parse_range_list("0,2-4") == [0, 2, 3, 4]
    with pytest.raises(ValueError):
        parse_range_list("3,1")
    from dscore.errors import FragmentAccessError

    # the accessor is dscore's now (tests/distributed/test_zero_fragments.py): a tensor no engine trains is refused
    with pytest.raises(FragmentAccessError, match="not a parameter of a live dscore engine"):
        safe_get_full_grad(torch.nn.Parameter(torch.ones(1, device="cpu")))


def test_precision_config_models_are_dscores_sections() -> None:
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config

    fp16 = DeepSpeedFP16Config(enabled=True, initial_scale_power=12)
    assert fp16.initial_scale_power == 12 and fp16.loss_scale_window == 1000
    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled
