"""LR schedulers against DeepSpeed's formulas (deepspeed-behaviour.md §3), written out independently here."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from pydantic import ValidationError

from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.specs import resolve
from dscore.testing.contexts import scheduler_context
from dscore_plugins.sched import config as cfg
from dscore_plugins.sched.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from dscore_plugins.sched.plugin import SCHEDULER_SPECS
from dscore_plugins.sched.torch_sched import torch_scheduler_factory


def _opt(lr: float = 0.1, groups: int = 1, cls=torch.optim.SGD, **kw):
    ps = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return cls(ps, lr=lr, **kw)


def _lrs_after(sched, opt, steps: int) -> list[float]:
    """lr of group 0 after construction (index 0) and after each of ``steps`` steps."""
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_hold() -> None:
    opt = _opt()
    s = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    got = _lrs_after(s, opt, 14)
    # construction writes min; step k sets t = k-1: lr = 0.01 + 0.09 * ln(k)/ln(10) while k-1 < 10
    assert got[0] == pytest.approx(0.01)
    assert got[1] == pytest.approx(0.01)  # t=0: ln(1)=0
    assert got[5] == pytest.approx(0.01 + 0.09 * math.log(5) / math.log(10))
    assert got[10] == pytest.approx(0.1)  # t=9: ln(10)/ln(10)
    assert got[14] == pytest.approx(0.1)
    assert s.get_last_lr() == [pytest.approx(0.1)]
    assert s.state_dict() == {"last_batch_iteration": 13}


def test_warmup_lr_linear_default_max_from_optimizer_and_min_two_steps() -> None:
    opt = _opt(lr=0.5)
    s = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    got = _lrs_after(s, opt, 6)
    assert got == pytest.approx([0.0, 0.0, 0.125, 0.25, 0.375, 0.5, 0.5])
    opt = _opt(lr=0.5)
    s = WarmupLR(opt, warmup_num_steps=1, warmup_type="linear")  # W clamped to 2
    assert _lrs_after(s, opt, 3) == pytest.approx([0.0, 0.0, 0.25, 0.5])


def test_warmup_lr_per_group_lists_and_bad_length() -> None:
    opt = _opt(groups=2)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2, warmup_type="linear")
    s.step()
    s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])
    with pytest.raises(ConfigError, match="expected 2 value"):
        WarmupLR(opt, warmup_max_lr=[1.0, 2.0, 3.0])


def test_warmup_lr_unknown_type_warns_and_uses_log(caplog: pytest.LogCaptureFixture) -> None:
    opt = _opt()
    with caplog.at_level(logging.WARNING, logger="dscore.sched"):
        s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cubic")
    assert "cubic" in caplog.text
    s.step(4)
    assert opt.param_groups[0]["lr"] == pytest.approx(math.log(5) / math.log(10))


@pytest.mark.parametrize("bad", [0, -5, 2.5, None, True])
def test_warmup_num_steps_must_be_positive_int(bad) -> None:
    with pytest.raises(ConfigError):
        WarmupLR(_opt(), warmup_num_steps=bad)
    with pytest.raises(ValidationError):
        cfg.WarmupLRParams(warmup_num_steps=bad)


def test_warmup_decay_lr_formula() -> None:
    opt = _opt()
    s = WarmupDecayLR(
        opt, total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=5, warmup_type="linear"
    )
    got = _lrs_after(s, opt, 25)
    # warm-up: t/5; then (20 - t)/(20 - 5), floored at 0
    for k, lr in enumerate(got[1:], start=1):
        t = k - 1
        want = t / 5 if t < 5 else max(0.0, (20 - t) / 15)
        assert lr == pytest.approx(want), t
    assert got[21] == pytest.approx(0.0) and got[25] == pytest.approx(0.0)


def test_warmup_decay_lr_missing_max_is_deepspeed_0_001() -> None:
    # DeepSpeed 0.19.8's WarmupDecayLR defaults warmup_max_lr to 0.001, whatever the optimizer lr is.
    opt = _opt(lr=0.3)
    s = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    assert s.max_lrs == [0.001]
    assert cfg.WarmupDecayLRParams(total_num_steps=10).warmup_max_lr == 0.001
    # None still means "take each group's lr"
    assert WarmupDecayLR(_opt(lr=0.3), total_num_steps=10, warmup_max_lr=None).max_lrs == [0.3]


def test_warmup_cosine_lr_formula() -> None:
    opt = _opt(lr=2.0, groups=2)
    opt.param_groups[1]["lr"] = 1.0
    s = WarmupCosineLR(opt, total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # t=-1: ratio 0
    seen = []
    for _ in range(15):
        s.step()
        seen.append(opt.param_groups[1]["lr"])
    for t, lr in enumerate(seen):
        if t < 4:
            r = 0.1 + 0.9 * math.log(t + 1) / math.log(4)
        else:
            p = min(1.0, (t - 4 + 1) / (12 - 4))
            r = max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2)
        assert lr == pytest.approx(r), t
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.01)  # past T: cos_min_ratio of the original lr


def test_one_cycle_lr_momentum_and_decay() -> None:
    opt = _opt(cls=torch.optim.Adam, lr=1.0, betas=(0.5, 0.5))
    s = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_lr_rate=0.5,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    for t in range(14):
        s.step()
        n = t + 1
        x = 1 + n / 10 - math.floor(1 + n / 10)
        f = x / 0.4 if x <= 0.4 else (x - 1) / (0.4 - 1)
        if t < 10:
            lr, mom = 0.1 + 1.0 * f, 0.9 - 0.1 * f
        else:
            d = t - 10 + 1
            lr, mom = 0.1 / (1 + 0.5 * d / 2), 0.9 * (1 + 0.1 * d / 2)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr), t
        b1, b2 = opt.param_groups[0]["betas"]
        assert (b1, b2) == (pytest.approx(mom), 0.99), t


def test_one_cycle_no_decay_and_sgd_disables_momentum(caplog: pytest.LogCaptureFixture) -> None:
    opt = _opt()
    with caplog.at_level(logging.WARNING, logger="dscore.sched"):
        s = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=2)
    assert "cycle_momentum disabled" in caplog.text and "betas" not in opt.param_groups[0]
    got = _lrs_after(s, opt, 6)
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0, 0.0, 0.0])
    with pytest.raises(ConfigError):
        OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=0)


def test_one_cycle_stairs_quantise_the_position() -> None:
    opt = _opt()
    s = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=8, cycle_first_stair_count=2, cycle_momentum=False)
    got = _lrs_after(s, opt, 8)[1:]
    # rising half f = n/8 quantised to floor(2 f)/2
    assert got == pytest.approx([math.floor(2 * n / 8) / 2 for n in range(1, 9)])


def test_lr_range_test_continuous_and_staircase() -> None:
    opt = _opt()
    s = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    got = _lrs_after(s, opt, 6)
    assert got == pytest.approx([0.01] + [0.01 * (1 + 2.0 * (t + 1) / 4) for t in range(6)])
    opt = _opt()
    s = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_staircase=True)
    got = _lrs_after(s, opt, 9)
    assert got == pytest.approx([0.01] + [0.01 * (1 + math.floor((t + 1) / 4)) for t in range(9)])


def test_state_dict_round_trip_restores_the_iteration_and_its_lr() -> None:
    opt = _opt()
    s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(5):
        s.step()
    sd = s.state_dict()
    assert sd == {"last_batch_iteration": 4}
    opt2 = _opt()
    s2 = WarmupLR(opt2, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    s2.load_state_dict(sd)
    # issue 33 item 5: the lr of the restored step is written at once (DeepSpeed waits for the next step)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.4) and s2.get_last_lr() == pytest.approx([0.4])
    s2.step()
    s.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_tensor_lr_is_filled_in_place() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear")
    s.step()
    s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.5)


def test_specs_resolve_and_params_models_validate() -> None:
    names = {s.name for s in SCHEDULER_SPECS}
    assert names == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "torch"}
    for spec in SCHEDULER_SPECS:
        assert callable(resolve(spec.factory))
        if spec.params_model:
            resolve(spec.params_model)
    with pytest.raises(ValidationError):
        cfg.WarmupLRParams(warmup_max_lr=0.1, nonsense=1)
    with pytest.raises(ValidationError):
        cfg.WarmupDecayLRParams()  # total_num_steps required
    with pytest.raises(ValidationError):
        cfg.OneCycleParams(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_second_step_size=-1)
    ctx = scheduler_context("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 2})
    assert isinstance(ctx.section, cfg.WarmupDecayLRParams) and ctx.section.warmup_max_lr == 0.001
    sched = resolve("dscore_plugins.sched.lr_schedules:build_warmup_decay_lr")(_opt(lr=0.001), ctx)
    assert sched.warmup_num_steps == 2 and sched.total_num_steps == 100 and sched.max_lrs == [0.001]


def test_torch_fallback_by_name_and_did_you_mean() -> None:
    from dscore.protocols import SchedulerContext, TorchClassParams

    ctx = scheduler_context("StepLR", {"step_size": 2, "gamma": 0.5})

    def with_section(type_name: str, **params: object) -> SchedulerContext:
        section = TorchClassParams(type_name=type_name, params=params)
        return SchedulerContext(config=ctx.config, section=section, runtime=ctx.runtime, path="scheduler.params")

    opt = _opt(lr=1.0)
    s = torch_scheduler_factory(opt, ctx)
    assert isinstance(s, torch.optim.lr_scheduler.StepLR) and s.step_size == 2 and s.gamma == 0.5
    assert isinstance(torch_scheduler_factory(_opt(), with_section("steplr", step_size=1)), torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ComponentNotFoundError) as info:
        torch_scheduler_factory(_opt(), with_section("WarmupLr2"))
    assert "WarmupLR" in info.value.suggestions
    with pytest.raises(ConfigError, match="StepLR") as bad:
        torch_scheduler_factory(_opt(), with_section("StepLR", bogus=1))
    assert bad.value.path == "scheduler.params"


def test_manifests_and_params_models_do_not_import_torch() -> None:
    import subprocess
    import sys

    mods = [
        "dscore_plugins.optim.plugin",
        "dscore_plugins.optim.config",
        "dscore_plugins.sched.plugin",
        "dscore_plugins.sched.config",
        "dscore_plugins.precision.plugin",
        "dscore_plugins.monitor.plugin",
    ]
    code = f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
