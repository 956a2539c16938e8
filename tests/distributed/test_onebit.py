"""OneBitAdam / OneBitLamb on 2 gloo ranks: error-feedback 1-bit momentum compression trains a toy problem.

The helper plays the engine's part: it averages gradients across ranks only while the optimizer says
``gradient_allreduce_needed`` (warm-up); afterwards each rank feeds its *local* gradient and the optimizer
all-gathers compressed signs + scales.
"""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed


def _train_toy(opt_name: str, steps: int, freeze_step: int, lr: float) -> dict:
    import torch
    import torch.distributed as dist

    from dscore_plugins.optim.onebit import OneBitAdam, OneBitLamb

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    w_true = torch.randn(16, 1, generator=gen)
    x_all = torch.randn(2 * 128, 16, generator=gen)
    y_all = x_all @ w_true + 0.01 * torch.randn(2 * 128, 1, generator=gen)
    x, y = x_all[rank::world], y_all[rank::world]  # each rank has its own shard
    model = torch.nn.Linear(16, 1)
    torch.manual_seed(1)
    model.reset_parameters()  # same init on both ranks
    cls = OneBitAdam if opt_name == "adam" else OneBitLamb
    opt = cls(model.parameters(), lr=lr, freeze_step=freeze_step)

    def full_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x_all), y_all).item()

    initial = full_loss()
    compressed_steps = 0
    batches = torch.Generator().manual_seed(10 + rank)  # different mini-batches on each rank
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (16,), generator=batches)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        if opt.gradient_allreduce_needed:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        else:
            compressed_steps += 1
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    errors = sum(float(opt.state[p]["worker_error"].abs().sum()) for p in model.parameters())
    return {
        "initial": initial,
        "final": full_loss(),
        "params": flat.tolist(),
        "compressed_steps": compressed_steps,
        "errors": errors,
    }


def _both() -> dict:
    return {
        "adam": _train_toy("adam", steps=150, freeze_step=40, lr=0.02),
        "lamb": _train_toy("lamb", steps=150, freeze_step=60, lr=0.1),
    }


@pytest.mark.slow
def test_onebit_adam_and_lamb_converge_on_two_gloo_ranks() -> None:
    r0, r1 = run_distributed(_both, 2, timeout=240)
    for name in ("adam", "lamb"):
        a, b = r0[name], r1[name]
        assert a["compressed_steps"] == (110 if name == "adam" else 90)
        assert a["errors"] > 0  # the compression really ran with error feedback
        assert a["params"] == b["params"], f"{name}: ranks diverged"
        assert a["final"] < 0.01 * a["initial"], f"{name}: {a['initial']} -> {a['final']}"


def _onebit_through_engine() -> list[float]:
    import torch

    import dscore

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3}},
    }
    engine, optimizer, _, _ = dscore.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    w_true = torch.linspace(-1, 1, 16)
    for _ in range(12):
        x = torch.randn(8, 16, generator=g)
        loss = (engine(x).squeeze(-1) - x @ w_true).pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert optimizer.gradient_allreduce_needed is False  # past freeze_step: the engine skips its all-reduce
    return [float(v) for v in torch.cat([p.detach().flatten() for p in engine.module.parameters()])]


def test_onebit_adam_through_the_engine_keeps_ranks_identical() -> None:
    from dscore.testing import run_distributed

    a, b = run_distributed(_onebit_through_engine, 2)
    assert a == b


def test_onebit_with_zero_partitions_is_refused() -> None:
    import pytest
    import torch

    import dscore
    from dscore.errors import ConfigError

    model = torch.nn.Linear(4, 1)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    with pytest.raises(ConfigError, match="zero_optimization.stage 0"):
        dscore.initialize(model=model, model_parameters=model.parameters(), config=cfg)
