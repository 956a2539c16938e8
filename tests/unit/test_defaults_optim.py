"""Every built-in optimizer and scheduler default against DeepSpeed 0.19.8 (issue 15 item 3, docs/defaults.md).

The tables below restate DeepSpeed's constructor defaults (FusedAdam, DeepSpeedCPUAdam, FusedLamb, FusedLion,
torch Adagrad / DeepSpeedCPUAdagrad, and the five ``lr_schedules`` classes). Each default is checked where it
takes effect: the hyper-parameters of the optimizer that ``dscore.initialize`` actually builds from a config
without the key, and the scheduler constructors and config models.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import dscore
from dscore.testing.contexts import optimizer_context
from dscore_plugins.optim.adam import build_adam, build_adam_offload
from dscore_plugins.sched import config as sched_cfg
from dscore_plugins.sched import lr_schedules

ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
OPTIMIZER_DEFAULTS = {
    "Adam": ADAM,
    "AdamW": ADAM,
    "Lamb": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0,
             "min_coeff": 0.01, "eps_inside_sqrt": False, "bias_correction": True},
    "Lion": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
    "Adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
}

SCHEDULER_DEFAULTS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                      "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"decay_lr_rate": 0.0, "cycle_first_step_size": 2000, "cycle_second_step_size": None,
                 "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
                 "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0,
                 "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
}


def _built(opt_type: str, params: dict | None = None, stage: int = 0) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": opt_type, "params": params or {}},
        "zero_optimization": {"stage": stage},
    }
    _, opt, _, _ = dscore.initialize(model=model, config=config)
    return opt


@pytest.mark.parametrize("opt_type", sorted(OPTIMIZER_DEFAULTS))
def test_config_optimizer_without_keys_gets_deepspeed_defaults(opt_type: str) -> None:
    group = _built(opt_type).param_groups[0]
    for key, want in OPTIMIZER_DEFAULTS[opt_type].items():
        have = tuple(group[key]) if isinstance(want, tuple) else group[key]
        assert have == want, f"{opt_type}.{key}: dscore {have!r}, DeepSpeed {want!r}"


@pytest.mark.parametrize("opt_type", ["Adam", "AdamW"])
@pytest.mark.parametrize("stage", [0, 2])
def test_issue_adam_config_has_weight_decay_zero(opt_type: str, stage: int) -> None:
    # issue 15 item 3: {"type": "Adam", "params": {"lr": 1e-3}} built weight_decay 0.01 (torch.optim.AdamW's default)
    opt = _built(opt_type, {"lr": 1e-3}, stage=stage)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0}


def test_issue_adam_trains_like_weight_decay_zero() -> None:
    """The numbers, not only the attribute: one step equals torch AdamW(weight_decay=0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in (*model.parameters(), *ref.parameters()):
            p.add_(5.0)  # large weights: a 0.01 decay would show
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-1}}}
    engine, *_ = dscore.initialize(model=model, config=config)
    x = torch.randn(2, 4)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-1, weight_decay=0.0)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_explicit_weight_decay_is_kept() -> None:
    assert _built("AdamW", {"lr": 1e-3, "weight_decay": 0.05}).param_groups[0]["weight_decay"] == 0.05


@pytest.mark.parametrize("adam_w_mode, torch_default", [(True, 0.01), (False, 0.0)])
def test_torch_adam_keeps_torch_default(adam_w_mode: bool, torch_default: float) -> None:
    # DeepSpeed's torch_adam: true path builds torch.optim.AdamW/Adam with the user's params only
    p = torch.nn.Parameter(torch.zeros(3))
    ctx = optimizer_context("Adam", {"adam_w_mode": adam_w_mode, "torch_adam": True, "lr": 1e-3})
    opt = build_adam([{"params": [p]}], ctx)
    assert opt.param_groups[0]["weight_decay"] == torch_default
    built = _built("Adam", {"lr": 1e-3, "torch_adam": True})
    assert type(built) is torch.optim.AdamW and built.param_groups[0]["weight_decay"] == 0.01


def test_offload_adam_defaults_weight_decay_zero() -> None:
    # DeepSpeedCPUAdam's default; torch_adam under offload keeps torch's (as DeepSpeed)
    p = torch.nn.Parameter(torch.zeros(3))
    ctx = optimizer_context("Adam", {"torch_adam": True, "lr": 1e-3}, offload=True)
    assert build_adam_offload([{"params": [p]}], ctx).param_groups[0]["weight_decay"] == 0.01
    q = torch.nn.Parameter(torch.zeros(3))
    ctx = optimizer_context("Adam", {"lr": 1e-3}, offload=True)
    assert build_adam_offload([{"params": [q]}], ctx).param_groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("name", sorted(SCHEDULER_DEFAULTS))
def test_scheduler_constructor_defaults_are_deepspeeds(name: str) -> None:
    sig = inspect.signature(getattr(lr_schedules, name))
    for key, want in SCHEDULER_DEFAULTS[name].items():
        have = sig.parameters[key].default
        assert have == want and type(have) is type(want), f"{name}.{key}: dscore {have!r}, DeepSpeed {want!r}"


@pytest.mark.parametrize("name", sorted(SCHEDULER_DEFAULTS))
def test_scheduler_config_model_defaults_are_deepspeeds(name: str) -> None:
    model = getattr(sched_cfg, f"{name}Params")
    required = {"total_num_steps": 10} if "total_num_steps" in model.model_fields else {}
    if name == "OneCycle":
        required = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}
    values = model(**required).model_dump()
    for key, want in SCHEDULER_DEFAULTS[name].items():
        assert values[key] == want, f"scheduler.params.{key} of {name}: dscore {values[key]!r}, DeepSpeed {want!r}"


def test_warmup_decay_lr_from_config_peaks_at_0_001() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
    }
    engine, _, _, sched = dscore.initialize(model=model, config=config)
    assert sched.max_lrs == [0.001]


@pytest.mark.parametrize(
    "params, want",
    [
        ({}, {True: 0.02, False: 3e-4}),  # MuonWithAuxAdam's per-half defaults (both were 0.02)
        ({"lr": 0.1}, {True: 0.1, False: 0.1}),  # lr goes to both halves
        ({"lr": 0.1, "adam_lr": 0.003}, {True: 0.1, False: 0.003}),
        ({"muon_lr": 0.05}, {True: 0.05, False: 3e-4}),
    ],
)
def test_muon_learning_rate_defaults(params: dict, want: dict) -> None:
    opt = _built("Muon", params)
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == want
    aux = next(g for g in opt.param_groups if not g["use_muon"])
    assert tuple(aux["betas"]) == (0.9, 0.95) and aux["eps"] == 1e-10 and aux["weight_decay"] == 0.0
    muon = next(g for g in opt.param_groups if g["use_muon"])
    assert muon["momentum"] == 0.95 and muon["weight_decay"] == 0.0
