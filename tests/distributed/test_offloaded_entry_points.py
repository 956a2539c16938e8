"""Every engine entry point after ``engine.offload_states()`` at ZeRO 0-3 (2 gloo ranks): it either works
(the same result as before offloading) or raises the EngineError naming the call and ``reload_states()``;
never a SIGSEGV (ZeRO 1-2's shared-memory all-gather read a freed storage) or a bare torch error (ZeRO-3's
setStorage out of bounds). A refused call changes nothing: after ``reload_states()`` the engine equals one
that was never offloaded. One process pair per stage walks the whole table."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import dscore
from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def _engine(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 6))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 40,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    return engine


def _batch(engine, seed: int):
    g = torch.Generator().manual_seed(seed + engine.global_rank)
    return torch.randn(4, 12, generator=g, device="cpu"), torch.randn(4, 6, generator=g, device="cpu")


def _loss(engine, seed: int):
    x, y = _batch(engine, seed)
    return F.mse_loss(engine(x), y)


def _train(engine, seed: int) -> None:
    engine.backward(_loss(engine, seed))
    engine.step()


def _table(engine, root: str, loss) -> dict:
    """Each entry point: ``"ok"`` (and its value) or the refusal's message."""
    stage = engine.zero_optimization_stage()
    calls = {
        "forward": lambda: engine(_batch(engine, 9)[0]),
        "eval forward": lambda: (engine.eval(), engine(_batch(engine, 9)[0]), engine.train()),
        "backward": lambda: engine.backward(loss),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "save_checkpoint": lambda: engine.save_checkpoint(os.path.join(root, f"offloaded{stage}")),
        "load_checkpoint": lambda: engine.load_checkpoint(os.path.join(root, f"saved{stage}")),
        "module_state_dict": engine.module_state_dict,
        "consolidated_16bit_state_dict": engine.consolidated_16bit_state_dict,
        "_zero3_consolidated_16bit_state_dict": engine._zero3_consolidated_16bit_state_dict,
        "save_16bit_model": lambda: engine.save_16bit_model(os.path.join(root, f"16bit{stage}")),
        "GatheredParameters": lambda: dscore.zero.GatheredParameters(list(engine.module.parameters())).__enter__(),
        "get_global_grad_norm": engine.get_global_grad_norm,
        "offload_states again": engine.offload_states,
    }
    out: dict = {}
    for name, call in calls.items():
        try:
            value = call()
        except Exception as exc:  # noqa: BLE001 - the table records what each call raised
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = ("ok", value if isinstance(value, (float, type(None))) else None)
    return out


def _walk(stage: int, root: str) -> dict:
    plain, moved = _engine(stage), _engine(stage)
    for e in (plain, moved):
        _train(e, 1)
        _train(e, 2)
    moved.save_checkpoint(os.path.join(root, f"saved{stage}"))
    norm = moved.get_global_grad_norm()
    loss = _loss(moved, 3)  # a graph built before offloading: backward after it must refuse
    moved.offload_states()
    table = _table(moved, root, loss)
    moved.reload_states()
    moved.reload_states()  # twice: a no-op
    for e in (plain, moved):
        _train(e, 3)
    a, b = plain.module_state_dict(), moved.module_state_dict()
    same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    moved.offload_states()
    moved.destroy()  # closing an offloaded engine works
    plain.close()
    return {"table": table, "norm": norm, "same": same}


def _all(root: str) -> dict:
    return {stage: _walk(stage, root) for stage in (0, 1, 2, 3)}


REFUSED = ["forward", "eval forward", "backward", "step", "zero_grad", "save_checkpoint", "load_checkpoint",
           "module_state_dict", "save_16bit_model"]


def test_every_entry_point_after_offload_states_works_or_refuses(tmp_path) -> None:
    results = run_distributed(_all, 2, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        for stage, r in res.items():
            table = r["table"]
            where = f"rank {rank} stage {stage}"
            for name in REFUSED:
                kind, msg = table[name]
                assert kind == "EngineError" and "reload_states() first" in msg, (where, name, table[name])
                assert msg.startswith(f"engine.{name.split()[-1]}()"), (where, name, msg)
            for name in ("consolidated_16bit_state_dict", "_zero3_consolidated_16bit_state_dict"):
                kind, msg = table[name]
                want = "reload_states() first" if stage == 3 else "needs ZeRO stage 3"
                assert kind == "EngineError" and want in msg, (where, name, msg)
            gathered = table["GatheredParameters"]
            if stage == 3:  # the unit refuses to gather freed partitions
                assert gathered[0] == "EngineError" and "reload_states() first" in gathered[1], (where, gathered)
            else:  # nothing is partitioned: a no-op
                assert gathered == ("ok", None), (where, gathered)
            assert table["get_global_grad_norm"] == ("ok", r["norm"]) and r["norm"] > 0, where
            assert table["offload_states again"] == ("ok", None), where
            assert r["same"], where  # nothing refused changed the state; reload (twice) restored it
    assert not os.path.exists(tmp_path / "offloaded0") and not os.path.exists(tmp_path / "16bit3")
