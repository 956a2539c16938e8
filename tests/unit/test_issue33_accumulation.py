"""Issue 33 items 1 and 8, issue 29 item 9 (zero_grad): accumulation owned by a wrapper, skipped steps.

Item 1 (Lightning #19350): ``gradient_accumulation_steps: 1`` and a loop that calls ``engine.backward()``
four times per ``engine.step()`` used to sum four micro-batches' gradients into one step without a word.
DeepSpeed counts micro steps in ``step()``; dscore keeps that rule and refuses the second ``backward`` of a
micro step under managed accumulation (naming ``gradient_accumulation_steps`` and
``set_gradient_accumulation_boundary``). A loop that owns boundaries through
``set_gradient_accumulation_boundary`` gets DeepSpeed's numbers: the gradients of every backward in the
window, each divided by ``gradient_accumulation_steps``.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dscore
from dscore.runtime.engine import EngineError

MB = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(MB, 4, generator=g) for _ in range(n)]


def _engine(stage: int, gas: int = 1, managed: bool = True, **extra):
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "managed_gradient_accumulation": managed,
        **extra,
    }
    engine, *_ = dscore.initialize(model=_model(), config=config)
    return engine


def _reference(windows: list[list[torch.Tensor]], divide_by: int) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in windows:
        for x in window:
            (model(x).pow(2).mean() / divide_by).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _params(engine) -> list[torch.Tensor]:
    if engine.zero_optimization_stage() == 3:
        with dscore.zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().clone() for p in engine.module.parameters()]
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_four_backwards_per_step_under_managed_accumulation_is_refused(stage: int) -> None:
    engine = _engine(stage, gas=1)
    data = _data(4)
    engine.backward(engine(data[0]).pow(2).mean())
    with pytest.raises(EngineError) as err:
        engine.backward(engine(data[1]).pow(2).mean())
    msg = str(err.value)
    assert "gradient_accumulation_steps=1" in msg and "set_gradient_accumulation_boundary" in msg
    assert engine.global_steps == 0
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_loop_owning_boundaries_gets_deepspeeds_numbers(stage: int) -> None:
    """Boundaries set by the wrapper (as HF Accelerate / Lightning do): 4 backwards, one step()."""
    gas = 4
    engine = _engine(stage, gas=gas)
    data = _data(8)
    for w in range(2):
        for i, x in enumerate(data[4 * w : 4 * w + 4]):
            engine.set_gradient_accumulation_boundary(i == 3)
            engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.global_steps == 2
    for a, b in zip(_params(engine), _reference([data[:4], data[4:]], gas)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_unmanaged_window_not_matching_the_config_is_warned(stage: int, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(stage, gas=1, managed=False)
    data = _data(4)
    with caplog.at_level(logging.WARNING, logger="dscore.runtime.engine"):
        for x in data:
            engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.global_steps == 1
    warned = [r.getMessage() for r in caplog.records if "gradient_accumulation_steps=1" in r.getMessage()]
    assert warned and "4 engine.backward() call(s)" in warned[0]
    # the numbers are DeepSpeed's for this loop: the sum of the four gradients (each divided by 1)
    for a, b in zip(_params(engine), _reference([data], 1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.close()


def test_one_backward_per_step_still_accumulates() -> None:
    engine = _engine(0, gas=4)
    data = _data(4)
    for x in data:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.global_steps == 1
    for a, b in zip(_params(engine), _reference([data], 4)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.close()


def test_backwards_inside_no_sync_do_not_count_as_micro_steps() -> None:
    """DeepSpeed's no_sync pattern (step() is illegal inside it): k-1 local backwards, one synced backward,
    one step(); the accumulation tracking is off inside the context, so nothing is refused."""
    engine = _engine(0, gas=1)
    data = _data(3)
    with engine.no_sync():
        for x in data[:2]:
            engine.backward(engine(x).pow(2).mean())
    engine.backward(engine(data[2]).pow(2).mean())
    engine.step()
    assert engine.global_steps == 1
    for a, b in zip(_params(engine), _reference([data], 1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.close()


# ---------------------------------------------------------------- item 8: skipped steps
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_skipped_step_is_a_warning_and_counted(precision: str, caplog: pytest.LogCaptureFixture) -> None:
    extra = {"fp16": {"enabled": True, "initial_scale_power": 4}} if precision == "fp16" else {"bf16": {"enabled": True}}
    engine = _engine(0, gas=1, **extra)
    x = _data(1)[0].to(engine.module[0].weight.dtype)
    with caplog.at_level(logging.WARNING, logger="dscore.runtime.engine"):
        for _ in range(3):
            engine.backward(engine(x).sum() * float("inf"))
            engine.step()
    assert engine.skipped_steps == 3 and engine.global_steps == 3
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "step 1 skipped" in lines[0] and "step 3 skipped" in lines[2]
    assert ("fp16 gradient overflow" if precision == "fp16" else "non-finite") in lines[0]
    engine.close()


def test_skipped_step_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(0, gas=1, bf16={"enabled": True})
    x = _data(1)[0].to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="dscore.runtime.engine"):
        for _ in range(25):
            engine.backward(engine(x).sum() * float("nan"))
            engine.step()
    lines = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert engine.skipped_steps == 25 and len(lines) == 10
    engine.close()


# ---------------------------------------------------------------- issue 29 item 9: zero_grad leaves None
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_leaves_grad_none_and_training_continues(stage: int) -> None:
    engine = _engine(stage, gas=1)
    data = _data(3)
    engine.backward(engine(data[0]).pow(2).mean())
    engine.zero_grad()
    assert all(p.grad is None for p in engine.module.parameters())
    for x in data[1:]:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    for a, b in zip(_params(engine), _reference([[x] for x in data[1:]], 1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.close()
