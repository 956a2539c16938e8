"""Resuming must reproduce: 20 steps straight == 10 steps, save, new processes, load, 10 more (bit-exact).

Two gloo ranks on CPU, gradient accumulation 2, WarmupDecayLR, Adam, dropout (so the RNG states matter) and
the engine's own sharded data loader (so the data position matters, across an epoch boundary).
"""

from __future__ import annotations

import os

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow

TOTAL, HALF = 20, 10


def _build():
    import torch

    import dscore

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(42)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": TOTAL, "warmup_num_steps": 4, "warmup_max_lr": 5e-3},
        },
    }
    engine, _, _, _ = dscore.initialize(model=model, training_data=data, config=config)
    return engine


def _train_until(engine, target: int) -> list[tuple[int, list[float], list[float]]]:
    """Train to ``target`` global steps; per step: (step, [micro-step losses], lr after the step)."""
    import torch

    records = []
    losses: list[float] = []
    while engine.global_steps < target:
        for x, y in engine.training_dataloader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            losses.append(loss.item())
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                records.append((engine.global_steps, losses, engine.get_lr()))
                losses = []
                if engine.global_steps >= target:
                    break
    return records


def _params(engine) -> dict[str, list[float]]:
    return {k: v.detach().flatten().tolist() for k, v in engine.module.state_dict().items()}


def _straight() -> dict:
    engine = _build()
    records = _train_until(engine, TOTAL)
    return {"records": records, "params": _params(engine)}


def _first_half(save_dir: str) -> dict:
    engine = _build()
    records = _train_until(engine, HALF)
    engine.save_checkpoint(save_dir, client_state={"note": "half"})
    return {"records": records}


def _second_half(save_dir: str) -> dict:
    engine = _build()
    path, client = engine.load_checkpoint(save_dir)
    assert client == {"note": "half"} and path is not None
    assert engine.global_steps == HALF and engine.micro_steps == 2 * HALF
    records = _train_until(engine, TOTAL)
    return {"records": records, "params": _params(engine)}


def test_resume_is_bit_exact(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    straight = run_distributed(_straight, 2, timeout=300)
    first = run_distributed(_first_half, 2, save_dir, timeout=300)
    assert os.path.exists(os.path.join(save_dir, f"global_step{HALF}", "_COMPLETE"))
    second = run_distributed(_second_half, 2, save_dir, timeout=300)
    for rank in range(2):
        ref = straight[rank]["records"]
        assert [r[0] for r in ref] == list(range(1, TOTAL + 1))
        assert first[rank]["records"] == ref[:HALF], f"rank {rank}: the first half already differs"
        got = second[rank]["records"]
        assert [r[0] for r in got] == list(range(HALF + 1, TOTAL + 1))
        for want, have in zip(ref[HALF:], got):
            assert want == have, f"rank {rank}, step {want[0]}: losses/lr {have} != {want}"
        assert second[rank]["params"] == straight[rank]["params"], f"rank {rank}: parameters differ after resume"
    # a sanity check that the comparison has teeth: the LR actually moved and dropout made ranks differ
    lrs = [r[2][0] for r in straight[0]["records"]]
    assert len(set(lrs)) > 5
    assert straight[0]["records"][0][1] != straight[1]["records"][0][1]
