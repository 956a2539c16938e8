"""DeepSpeed's public engine surface that scripts call (issue 15), and ``args.local_rank`` vs ``LOCAL_RANK``."""

from __future__ import annotations

import argparse

import pytest
import torch

import dscore
from dscore.runtime.initialize import InitializeError


def _engine(**overrides: object):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    config.update(overrides)
    engine, *_ = dscore.initialize(model=model, config=config)
    return engine


def test_defaults_of_a_plain_config() -> None:
    e = _engine()
    assert e.fp16_enabled() is False and e.bfloat16_enabled() is False and e.bf16_enabled() is False
    assert e.amp_enabled() is False
    assert e.gradient_clipping() == 1.0  # DeepSpeed 0.19.8's default: clipping on
    assert e.steps_per_print() is None
    assert e.wall_clock_breakdown() is False
    assert e.local_rank == 0 and e.world_size == 1 and e.mp_world_size == 1
    assert e.get_batch_info() == (6, 2, 3)
    assert e.zero_optimization() is False and e.zero_optimization_stage() == 0
    assert e.zero_offload_optimizer() is False and e.zero_offload_param() is False and e.zero_cpu_offload() is False
    assert e.optimizer_name() == "AdamW" and e.optimizer_params() == {"lr": 1e-3}
    assert e.scheduler_name() is None and e.scheduler_params() is None
    assert e.dynamic_loss_scale() is False
    assert e.postscale_gradients() is True and e.gradient_predivide_factor() == 1.0
    assert e.communication_data_type == torch.float32
    assert e.checkpoint_tag_validation_enabled() is True and e.checkpoint_tag_validation_fail() is False
    assert e.elasticity_enabled() is False and e.dataloader_drop_last() is False
    assert e.zero_allow_untested_optimizer() is False and e.zero_force_ds_cpu_optimizer() is True
    assert set(e.module_state_dict()) == {"weight", "bias"}


def test_values_follow_the_config() -> None:
    e = _engine(
        fp16={"enabled": True, "initial_scale_power": 5},
        gradient_clipping=0.5,
        steps_per_print=7,
        wall_clock_breakdown=True,
        prescale_gradients=True,
        gradient_predivide_factor=2.0,
        zero_optimization={"stage": 2},
        checkpoint={"tag_validation": "FAIL"},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    )
    assert e.fp16_enabled() is True and e.bfloat16_enabled() is False
    assert e.dynamic_loss_scale() is True and e.loss_scale() == 0.0 and e.initial_dynamic_scale() == 32.0
    assert e.gradient_clipping() == 0.5 and e.steps_per_print() == 7 and e.wall_clock_breakdown() is True
    assert e.postscale_gradients() is False and e.gradient_predivide_factor() == 2.0
    assert e.zero_optimization() is True and e.zero_optimization_stage() == 2
    assert e.communication_data_type == torch.float16
    assert e.checkpoint_tag_validation_fail() is True
    assert e.scheduler_name() == "WarmupLR" and e.scheduler_params() == {"warmup_num_steps": 5}
    b = _engine(bf16={"enabled": True}, communication_data_type="fp32")
    assert b.bfloat16_enabled() is True and b.communication_data_type == torch.float32


def test_args_local_rank_disagreeing_with_env_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = argparse.Namespace(local_rank=1)
    with pytest.raises(InitializeError, match=r"args.local_rank=1 .*LOCAL_RANK=0"):
        dscore.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1})


def test_args_local_rank_agreeing_or_unset_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    for value in (0, -1):
        args = argparse.Namespace(local_rank=value)
        dscore.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1})
        assert args.local_rank == 0  # the launcher's value is written back, as DeepSpeed does


def test_args_local_rank_must_be_an_int(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(InitializeError, match="must be an int"):
        dscore.initialize(args=argparse.Namespace(local_rank="0"), model=torch.nn.Linear(2, 2),
                          config={"train_micro_batch_size_per_gpu": 1})


def test_zero_accessors() -> None:
    e = _engine(zero_optimization={"stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000})
    assert e.zero_reduce_bucket_size() == 1000 and e.zero_allgather_bucket_size() == 2000
    assert e.zero_overlap_comm() is False  # unset: true only at stage 3
    assert e.zero_contiguous_gradients() is True and e.zero_reduce_scatter() is True
    assert e.zero_gather_16bit_weights_on_model_save() is False
    e3 = _engine(zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    assert e3.zero_overlap_comm() is True and e3.zero_gather_16bit_weights_on_model_save() is True
