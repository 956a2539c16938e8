"""fp16 loss scalers (both DeepSpeed algorithms, deepspeed-behaviour.md §5.1), overflow detection, precision modes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dscore.errors import ConfigError, DscoreError
from dscore.specs import resolve
from dscore_plugins.precision.config import Bf16Config, Fp16Config
from dscore_plugins.precision.loss_scaler import DynamicLossScaler, LossScaleUnderflowError, StaticLossScaler
from dscore_plugins.precision.overflow import has_overflow, overflow_flag
from dscore_plugins.precision.precision import Bf16Mode, Fp16Mode, Fp32Mode, build_fp16
from dscore_plugins.sched.lr_schedules import WarmupLR


def _run(scaler, overflows):
    """Scale after each update."""
    out = []
    for ovf in overflows:
        assert scaler.update(ovf) is ovf
        out.append(scaler.loss_scale)
    return out


def test_fp16_optimizer_algorithm_halves_at_once_and_grows_after_window() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=2, min_scale=1, hysteresis=2, algorithm="fp16_optimizer")
    assert _run(s, [False, False, True, False, False, False, False]) == [16, 16, 8, 8, 8, 16, 16]


def test_fp16_optimizer_algorithm_ignores_hysteresis_and_raises_at_minimum_like_zero() -> None:
    # Issue 15 item 6: one behaviour at min_loss_scale for every stage (it used to clamp silently here).
    s = DynamicLossScaler(init_scale=16, scale_window=100, min_scale=4, hysteresis=5, algorithm="fp16_optimizer")
    assert _run(s, [True, True]) == [8, 4]
    with pytest.raises(LossScaleUnderflowError, match="min_loss_scale=4"):
        s.update(True)


def test_zero_algorithm_honours_hysteresis_and_raises_at_minimum() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=2, min_scale=4, hysteresis=2, algorithm="zero")
    assert _run(s, [True, True, False, True]) == [16, 8, 8, 4]
    with pytest.raises(LossScaleUnderflowError) as info:
        s.update(True)
    assert isinstance(info.value, FloatingPointError) and isinstance(info.value, DscoreError)


def test_zero_algorithm_refills_hysteresis_when_the_scale_grows() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=2, min_scale=1, hysteresis=2, algorithm="zero")
    assert _run(s, [True, False, False, False, True, True]) == [16, 16, 16, 32, 32, 16]


def test_consecutive_hysteresis_refills_after_every_clean_step() -> None:
    consecutive = DynamicLossScaler(16, 1000, 1, 2, True, algorithm="zero")
    plain = DynamicLossScaler(16, 1000, 1, 2, False, algorithm="zero")
    assert _run(consecutive, [True, False, True, True]) == [16, 16, 16, 8]
    assert _run(plain, [True, False, True, True]) == [16, 16, 8, 4]


def test_hysteresis_one_halves_immediately_under_zero_rules() -> None:
    s = DynamicLossScaler(8, 1000, 2, 1, algorithm="zero")
    assert _run(s, [True, True]) == [4, 2]
    with pytest.raises(LossScaleUnderflowError):
        s.update(True)


def test_dynamic_state_dict_round_trip() -> None:
    a = DynamicLossScaler(64, 3, 1, 2, algorithm="zero")
    _run(a, [True, False, True, False])
    b = DynamicLossScaler(64, 3, 1, 2, algorithm="zero")
    b.load_state_dict(a.state_dict())
    seq = [False, False, False, True, True, False]
    assert _run(b, seq) == _run(a, seq)


def test_static_scaler_skips_overflow_and_never_changes() -> None:
    s = StaticLossScaler(128.0)
    assert _run(s, [True, False, True]) == [128.0, 128.0, 128.0]
    assert s.state_dict() == {"dynamic": False, "cur_scale": 128.0}
    with pytest.raises(ConfigError):
        StaticLossScaler(0.0)
    with pytest.raises(ConfigError):
        DynamicLossScaler(16, 0)


def test_issue_example_six_overflows_then_four_good_steps() -> None:
    """fp16 (stage 0), WarmupLR with 10 warm-up steps: steps 1-6 overflow, 7-10 are fine."""
    mode = Fp16Mode(
        Fp16Config(
            enabled=True,
            loss_scale=0,
            initial_scale_power=16,
            loss_scale_window=1000,
            hysteresis=2,
            consecutive_hysteresis=False,
            min_loss_scale=1,
        )
    )
    scaler = mode.make_loss_scaler(zero_stage=0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    global_steps = skipped_steps = sched_steps = 0
    for step in range(1, 11):
        if scaler.update(overflow=step <= 6):
            skipped_steps += 1
        else:
            sched.step()
            sched_steps += 1
        global_steps += 1
    assert (global_steps, skipped_steps, sched_steps) == (10, 6, 4)
    assert sched.last_batch_iteration == 3
    assert scaler.loss_scale == 2.0**16 / 2**6
    assert opt.param_groups[0]["lr"] == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(10.0)).item()
    )


def test_precision_modes_pick_the_algorithm_by_zero_stage() -> None:
    cfg = {
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 5,
            "loss_scale_window": 7,
            "hysteresis": 3,
            "consecutive_hysteresis": True,
            "min_loss_scale": 2,
        }
    }
    mode = Fp16Mode(Fp16Config(**cfg["fp16"]))
    s0, s2 = mode.make_loss_scaler(zero_stage=0), mode.make_loss_scaler(zero_stage=2)
    assert isinstance(s0, DynamicLossScaler) and s0.algorithm == "fp16_optimizer"
    assert isinstance(s2, DynamicLossScaler) and s2.algorithm == "zero"
    assert (s2.loss_scale, s2.scale_window, s2.hysteresis, s2.consecutive_hysteresis, s2.min_scale) == (
        32.0,
        7,
        3,
        True,
        2.0,
    )
    static = Fp16Mode(Fp16Config(enabled=True, loss_scale=256)).make_loss_scaler(zero_stage=1)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0
    assert mode.check_overflow and mode.compute_dtype == torch.float16
    assert Fp32Mode().make_loss_scaler(zero_stage=0) is None and not Fp32Mode().check_overflow
    assert Bf16Mode().check_overflow is True  # DeepSpeed 0.19.x default (from the bf16 model)
    off = Bf16Mode(Bf16Config(enabled=True, check_grad_overflow=False))
    assert off.check_overflow is False and off.make_loss_scaler(zero_stage=3) is None
    assert off.compute_dtype == torch.bfloat16


def test_prepare_module_casts_floats_only() -> None:
    m = torch.nn.Linear(2, 2)
    m.register_buffer("count", torch.zeros(1, dtype=torch.long))
    Bf16Mode().prepare_module(m)
    assert m.weight.dtype == torch.bfloat16 and m.count.dtype == torch.long
    m2 = torch.nn.Linear(2, 2)
    assert Fp32Mode().prepare_module(m2).weight.dtype == torch.float32


def test_overflow_detection_real_fp16_grads() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).half()
    x = torch.randn(4, 8).half()
    (model(x).float().sum() * 60000.0).backward()
    grads = [p.grad for p in model.parameters()]
    assert has_overflow(grads)  # 60000 * |sum x| exceeds fp16's 65504
    model.zero_grad()
    model(x).float().sum().backward()
    assert not has_overflow([p.grad for p in model.parameters()])
    big = torch.full((1000,), 60000.0, dtype=torch.float16)  # finite but an L2 norm would overflow fp16
    assert not has_overflow([big, None, torch.empty(0)])
    assert has_overflow([torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])
    assert overflow_flag([]).item() == 0.0


def test_precision_specs_resolve() -> None:
    from dscore_plugins.precision.plugin import dscore_register_precisions

    specs = {s.name: s for s in dscore_register_precisions()}
    assert (specs["fp32"].config_key, specs["fp16"].config_key, specs["bf16"].config_key) == (None, "fp16", "bf16")
    assert resolve(specs["fp16"].factory) is build_fp16


def test_modes_read_the_config_engineers_section_models() -> None:
    pcfg = pytest.importorskip("dscore_plugins.precision.config")
    config = SimpleNamespace(
        fp16=pcfg.Fp16Config(enabled=True, initial_scale_power=8, loss_scale_window=3, hysteresis=1, min_loss_scale=4),
        bf16=pcfg.Bf16Config(enabled=False, check_grad_overflow=False),
    )
    scaler = Fp16Mode(config.fp16).make_loss_scaler(zero_stage=3)
    assert (scaler.loss_scale, scaler.scale_window, scaler.hysteresis, scaler.min_scale) == (256.0, 3, 1, 4.0)
    assert _run(scaler, [False, False, False, False, True]) == [256, 256, 256, 512, 256]
    assert Bf16Mode(config.bf16).check_overflow is False
