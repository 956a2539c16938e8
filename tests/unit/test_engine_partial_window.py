"""A partial accumulation window (issue 15 item 9): warned about at save/close, applied or dropped on request.

``gradient_accumulation_steps: 4`` and 6 micro-batches: one optimizer step, and the last 2 micro-batches'
gradients used to stay pending without a word.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dscore
from dscore.runtime.engine import EngineError

GAS, MB = 4, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(MB, 4, generator=g) for _ in range(n)]


def _engine(stage: int):
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = dscore.initialize(model=_model(), config=config)
    return engine


def _run(engine, batches) -> None:
    for x in batches:
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _reference(windows: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for window in windows:
        for x in window:
            (model(x).pow(2).mean() / GAS).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _assert_params(engine, want) -> None:
    for a, b in zip(engine.module.parameters(), want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 2])
def test_apply_steps_with_the_partial_window(stage: int) -> None:
    data = _data(6 + GAS)
    engine = _engine(stage)
    _run(engine, data[:6])
    assert engine.global_steps == 1 and engine.pending_micro_batches == 2
    assert engine.flush_gradient_accumulation(apply=True) is True
    assert engine.global_steps == 2 and engine.pending_micro_batches == 0
    assert engine.global_samples == GAS * MB + 2 * MB
    assert engine.micro_steps == 2 * GAS  # the next micro-batch starts a window
    _assert_params(engine, _reference([data[:4], data[4:6]]))
    # a full window afterwards steps at its 4th micro-batch, as an uninterrupted loop would
    _run(engine, data[6:])
    assert engine.global_steps == 3
    _assert_params(engine, _reference([data[:4], data[4:6], data[6:]]))


@pytest.mark.parametrize("stage", [0, 2])
def test_drop_discards_the_partial_window(stage: int) -> None:
    data = _data(6 + GAS)
    engine = _engine(stage)
    _run(engine, data[:6])
    assert engine.flush_gradient_accumulation(apply=False) is False
    assert engine.global_steps == 1 and engine.pending_micro_batches == 0 and engine.micro_steps == GAS * 2
    _assert_params(engine, _reference([data[:4]]))
    _run(engine, data[6:])  # the dropped gradients must not leak into this window
    _assert_params(engine, _reference([data[:4], data[6:]]))


def test_flush_with_nothing_pending_is_a_no_op() -> None:
    engine = _engine(0)
    _run(engine, _data(GAS))
    before = [p.detach().clone() for p in engine.module.parameters()]
    assert engine.flush_gradient_accumulation(apply=True) is False
    assert engine.global_steps == 1 and engine.micro_steps == GAS
    _assert_params(engine, before)


def test_pending_gradients_warn_at_save_and_close(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(0)
    _run(engine, _data(6))
    with caplog.at_level(logging.WARNING, logger="dscore.runtime.engine"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert "save_checkpoint() with gradients of 2 micro-batch(es) pending" in caplog.text
    assert "flush_gradient_accumulation" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscore.runtime.engine"):
        engine.close()
    assert "engine.close() with gradients of 2 micro-batch(es) pending" in caplog.text


def test_no_warning_at_a_boundary(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(0)
    _run(engine, _data(GAS))
    with caplog.at_level(logging.WARNING, logger="dscore.runtime.engine"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.close()
    assert "pending" not in caplog.text


def test_flush_refused_in_unmanaged_mode() -> None:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = dscore.initialize(model=_model(), config=config)
    with pytest.raises(EngineError, match="managed"):
        engine.flush_gradient_accumulation(apply=True)


def test_set_gradient_accumulation_boundary_none_returns_to_the_counter() -> None:
    # DeepSpeed's recipe for a partial window: force the boundary for its last backward, then hand back
    engine = _engine(0)
    data = _data(2 + GAS)
    engine.backward(engine(data[0]).pow(2).mean())
    engine.step()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(data[1]).pow(2).mean())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    engine.set_gradient_accumulation_boundary(None)
    assert engine.is_gradient_accumulation_boundary() is False
    _assert_params(engine, _reference([data[:2]]))
