"""OneCycle against DeepSpeed 0.19.8: stairs quantised from the integer cycle position, per-group lists.

Issue 15 item 5: with stairs, dscore's lr after the first engine step was 0.001 where DeepSpeed's is 0.0019
(flooring the float scale factor lost a stair to rounding: one step behind for the whole cycle).
"""

from __future__ import annotations

import math

import pytest
import torch

import dscore
from dscore.errors import ConfigError
from dscore_plugins.sched import config as cfg
from dscore_plugins.sched.lr_schedules import OneCycle

ISSUE_PARAMS = {
    "cycle_min_lr": 0.001,
    "cycle_max_lr": 0.01,
    "cycle_first_step_size": 10,
    "cycle_second_step_size": 21,
    "cycle_first_stair_count": 10,
    "cycle_second_stair_count": 21,
}


def _opt(groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.5} for _ in range(groups)]
    return torch.optim.Adam(params)


def _deepspeed_stair_factor(n: int, s1: int, s2: int, k1: int, k2: int) -> float:
    """DeepSpeed's stair rule, restated with exact integers (n = t + 1 batches done)."""
    total = s1 + s2
    c = n % total
    if c <= s1:
        return math.floor(c * k1 / s1) / k1
    return math.floor((total - c) * k2 / s2) / k2


def test_issue_config_first_engine_step_gives_0_0019() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
        "scheduler": {"type": "OneCycle", "params": dict(ISSUE_PARAMS)},
    }
    engine, _, _, sched = dscore.initialize(model=model, config=config)
    assert engine.get_lr() == [pytest.approx(0.001)]
    x = torch.randn(2, 3)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert engine.get_lr()[0] == pytest.approx(0.0019, abs=1e-12)
    assert sched.get_last_lr()[0] == pytest.approx(0.0019, abs=1e-12)


def test_stairs_match_the_integer_rule_over_two_cycles() -> None:
    opt = _opt()
    s = OneCycle(opt, **ISSUE_PARAMS, cycle_momentum=False)
    for t in range(62):
        s.step()
        f = _deepspeed_stair_factor(t + 1, 10, 21, 10, 21)
        want = 0.001 + (0.01 - 0.001) * f if t < 31 else 0.001
        assert opt.param_groups[0]["lr"] == pytest.approx(want, abs=1e-12), t


def test_stairs_reach_the_peak_on_an_asymmetric_cycle() -> None:
    # 3/7: the float scale at the half-cycle edge lands 1 ulp under 1.0; the peak must still be reached.
    opt = _opt()
    s = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=3, cycle_second_step_size=7, cycle_first_stair_count=3,
                 cycle_momentum=False)
    lrs = []
    for _ in range(10):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert max(lrs) == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0)  # t = 2: three batches done = the end of the rising half


def test_no_stairs_is_the_continuous_triangle() -> None:
    opt = _opt()
    s = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_momentum=False)
    got = []
    for _ in range(8):
        s.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_per_group_lists_for_lr_and_momentum() -> None:
    opt = _opt(groups=2)
    s = OneCycle(
        opt,
        cycle_min_lr=[0.001, 0.002],
        cycle_max_lr=[0.01, 0.02],
        cycle_first_step_size=4,
        cycle_min_mom=[0.8, 0.7],
        cycle_max_mom=[0.9, 0.95],
    )
    assert [g["lr"] for g in opt.param_groups] == [0.001, 0.002]
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.7, 0.99)]
    s.step()  # f = 0.25
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.001 + 0.009 * 0.25, 0.002 + 0.018 * 0.25])
    b = [g["betas"][0] for g in opt.param_groups]
    assert b == pytest.approx([0.9 - 0.1 * 0.25, 0.95 - 0.25 * 0.25])
    # the config model accepts the lists too (it refused them before)
    cfg.OneCycleParams(cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.02], cycle_min_mom=[0.8, 0.7],
                       cycle_max_mom=[0.9, 0.95])


@pytest.mark.parametrize("key", ["cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"])
def test_per_group_list_length_mismatch_names_the_key(key: str) -> None:
    kwargs = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}
    kwargs[key] = [0.5, 0.6, 0.7]
    with pytest.raises(ConfigError, match=key) as info:
        OneCycle(_opt(groups=2), **kwargs)
    assert "expected 2" in str(info.value)


def test_per_group_lists_through_initialize() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02], "cycle_first_step_size": 2},
        },
    }
    engine, _, _, _ = dscore.initialize(model=model, optimizer=opt, config=config)
    assert engine.get_lr() == pytest.approx([0.001, 0.002])
    engine.backward(engine(torch.randn(2, 3)).pow(2).mean())
    engine.step()
    assert engine.get_lr() == pytest.approx([0.0055, 0.011])
