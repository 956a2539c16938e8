"""Under ZeRO optimizer offload, Adam/AdamW become the cpu_adam op's DscoreCPUAdam (DeepSpeed swaps in
DeepSpeedCPUAdam there); torch_adam keeps torch's; without offload torch's fused AdamW is used."""

from __future__ import annotations

import pytest
import torch

import dscore


def _engine(zero: dict, opt_params: dict | None = None):
    model = torch.nn.Linear(8, 4)
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, **(opt_params or {})}},
        "zero_optimization": zero,
    }
    engine, optimizer, _, _ = dscore.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, optimizer


@pytest.mark.slow
def test_offload_uses_cpu_adam_op_and_trains() -> None:
    engine, optimizer = _engine({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    assert type(optimizer).__name__ == "DscoreCPUAdam"
    x = torch.randn(2, 8)
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))


def test_torch_adam_keeps_torch_under_offload() -> None:
    _, optimizer = _engine({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"torch_adam": True})
    assert isinstance(optimizer, torch.optim.AdamW)


def test_without_offload_torch_adamw() -> None:
    _, optimizer = _engine({"stage": 2})
    assert isinstance(optimizer, torch.optim.AdamW)
