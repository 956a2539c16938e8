"""Resuming with another accumulation window (issue 15 item 8).

A ZeRO stage 1 checkpoint saved at world size 2 with ``gradient_accumulation_steps: 1`` is loaded at world
size 1 with ``gradient_accumulation_steps: 2`` (the same global batch of 4). The restored micro-step counter
used to put the accumulation boundary after the first micro-batch (an update from half the gradient); the
load must start at a boundary, so the next step equals an uninterrupted single-process PyTorch run.
"""

from __future__ import annotations

import os

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow

STEPS_BEFORE, LR = 3, 1e-2


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 5, generator=g)


def _engine(gas: int):
    import dscore

    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4 // gas // _world(),
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = dscore.initialize(model=_model(), config=config)
    return engine


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _save_at_two_ranks(save_dir: str) -> None:
    import torch.distributed as dist

    engine = _engine(gas=1)
    r = dist.get_rank()
    for step in range(STEPS_BEFORE):
        x = _batch(step)[2 * r : 2 * r + 2]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")


def _load_at_one_rank_and_step(save_dir: str) -> dict:
    engine = _engine(gas=2)
    engine.load_checkpoint(save_dir, tag="t")
    boundary_first = engine.is_gradient_accumulation_boundary()
    x = _batch(STEPS_BEFORE)
    applied = []
    for k in range(2):
        engine.backward(engine(x[2 * k : 2 * k + 2]).pow(2).mean())
        engine.step()
        applied.append(engine.was_step_applied())
    return {
        "boundary_first": boundary_first,
        "applied": applied,
        "global_steps": engine.global_steps,
        "params": [p.detach().clone().tolist() for p in engine.module.parameters()],
    }


def _reference() -> list:
    import torch

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS_BEFORE + 1):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone().tolist() for p in model.parameters()]


def test_load_with_another_window_starts_at_a_boundary(tmp_path) -> None:
    import torch

    save_dir = os.path.join(tmp_path, "ckpt")
    run_distributed(_save_at_two_ranks, 2, save_dir, timeout=300)
    (got,) = run_distributed(_load_at_one_rank_and_step, 1, save_dir, timeout=300)
    assert got["boundary_first"] is False  # gas 2: the first micro-batch after the load is not a boundary
    assert got["applied"] == [False, True]
    assert got["global_steps"] == STEPS_BEFORE + 1
    for have, want in zip(got["params"], _reference()):
        torch.testing.assert_close(torch.tensor(have), torch.tensor(want), rtol=1e-5, atol=1e-6)
