"""Matrix case (issue 15, item 8): save at world size 2 with ``gradient_accumulation_steps: 1``, load at
world size 1 with ``gradient_accumulation_steps: 2`` (same global batch), continue, and compare with an
uninterrupted world-size-2 run and with plain PyTorch.

A load must start at an accumulation boundary whatever the saved window was: the first two micro-batches
after the load form one optimizer step.
"""

from __future__ import annotations

from typing import Any

import pytest

from dscore.testing import run_distributed

IN, OUT, MICRO = 4, 3, 2
BEFORE, AFTER = 3, 2  # optimizer steps before the save / after the load
LR = 0.01


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, OUT))


def _data() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(11)
    n = 2 * MICRO * (BEFORE + AFTER)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def _config(gas: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }


def _micro(engine: Any, rows: slice) -> None:
    x, y = _data()
    engine.backward(((engine(x[rows]) - y[rows]) ** 2).mean())
    engine.step()


def _world2(save_dir: str) -> dict[str, Any]:
    """Interrupted run (BEFORE steps, save) and uninterrupted run (BEFORE + AFTER steps) at world size 2."""
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    engine, *_ = dscore.initialize(model=_model(), config=_config(1))
    for s in range(BEFORE):
        _micro(engine, slice(s * 2 * MICRO + rank * MICRO, s * 2 * MICRO + (rank + 1) * MICRO))
    engine.save_checkpoint(save_dir, tag="mid")
    full, *_ = dscore.initialize(model=_model(), config=_config(1))
    for s in range(BEFORE + AFTER):
        _micro(full, slice(s * 2 * MICRO + rank * MICRO, s * 2 * MICRO + (rank + 1) * MICRO))
    return {k: v.numpy().copy() for k, v in full.zero_stage_impl.module_state_dict().items()}


def _world1(save_dir: str) -> dict[str, Any]:
    import dscore

    engine, *_ = dscore.initialize(model=_model(), config=_config(2))
    engine.load_checkpoint(save_dir, tag="mid")
    assert engine.global_steps == BEFORE
    for s in range(BEFORE, BEFORE + AFTER):
        for m in range(2):
            _micro(engine, slice(s * 2 * MICRO + m * MICRO, s * 2 * MICRO + (m + 1) * MICRO))
    return {
        "params": {k: v.numpy().copy() for k, v in engine.zero_stage_impl.module_state_dict().items()},
        "global_steps": engine.global_steps,
    }


def _reference() -> dict[str, Any]:
    import torch

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    x, y = _data()
    for s in range(BEFORE + AFTER):
        rows = slice(s * 2 * MICRO, (s + 1) * 2 * MICRO)
        opt.zero_grad()
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_save_world2_gas1_load_world1_gas2_matches_uninterrupted(tmp_path: Any) -> None:
    import numpy as np

    save_dir = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_world2, 2, save_dir, timeout=300)[0]
    resumed = run_distributed(_world1, 1, save_dir, timeout=300)[0]
    ref = _reference()
    assert resumed["global_steps"] == BEFORE + AFTER
    for name, want in ref.items():
        np.testing.assert_allclose(uninterrupted[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(resumed["params"][name], uninterrupted[name], rtol=1e-5, atol=1e-6, err_msg=name)
