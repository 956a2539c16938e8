"""``engine.offload_states`` / ``reload_states``: states leave their storages and training after
offload -> reload equals never offloading, bit for bit (ZeRO 0-3, 2 gloo ranks; errors on one)."""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn.functional as F

import dscore
from dscore.errors import DscoreError
from dscore.testing import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 6))


def _config(stage: int, **extra: object) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 40},
    }
    cfg.update(extra)
    return cfg


def _train(engine, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + engine.global_rank)
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(4, 12, generator=g).to(dtype), torch.randn(4, 6, generator=g)
        engine.backward(F.mse_loss(engine(x).float(), y))
        engine.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.zero_stage_impl.module_state_dict().items()}


def _run_stage(stage: int, bf16: bool) -> dict:
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    plain, *_ = dscore.initialize(model=_model(), config=_config(stage, **extra))
    moved, *_ = dscore.initialize(model=_model(), config=_config(stage, **extra))
    _train(plain, 2, seed=1)
    _train(moved, 2, seed=1)
    kinds = moved.zero_stage_impl.offload_state_tensors()
    moved.offload_states()
    offloader = moved.__dict__["_state_offloader"]
    released = offloader.bytes_by_kind()
    # every listed tensor on the device lost its storage
    left = sum(t.untyped_storage().nbytes() for ts in kinds.values() for t in ts if t is not None)
    refused = ""
    try:
        moved(torch.randn(4, 12))
    except DscoreError as exc:
        refused = str(exc)
    moved.reload_states()
    _train(plain, 3, seed=2)
    _train(moved, 3, seed=2)
    a, b = _weights(plain), _weights(moved)
    same = all(torch.equal(a[k], b[k]) for k in a)
    # a subset: only the optimizer state goes, the parameters stay
    moved.offload_states(include=["optim_states"])
    subset = sorted(offloader.offloaded)
    param_bytes = sum(t.untyped_storage().nbytes() for t in moved.zero_stage_impl.offload_state_tensors()["lp_params"])
    moved.reload_states()
    _train(plain, 1, seed=3)
    _train(moved, 1, seed=3)
    a, b = _weights(plain), _weights(moved)
    same_after_subset = all(torch.equal(a[k], b[k]) for k in a)
    plain.close()
    moved.close()
    return {
        "released": released,
        "left": left,
        "refused": refused,
        "same": same,
        "subset": subset,
        "param_bytes": param_bytes,
        "same_after_subset": same_after_subset,
        "offloaded_after": sorted(offloader.offloaded),
    }


def _all_stages() -> dict:
    return {
        f"{stage}/{bf16}": _run_stage(stage, bf16) for stage, bf16 in ((0, False), (1, True), (2, False), (3, True))
    }


@pytest.mark.slow
def test_offload_reload_is_bit_identical_on_two_ranks() -> None:
    results = run_distributed(_all_stages, 2, timeout=400)
    for rank, res in enumerate(results):
        for key, r in res.items():
            where = f"rank {rank} stage/bf16 {key}"
            assert r["same"] and r["same_after_subset"], where
            assert r["left"] == 0, where  # nothing listed keeps device storage while offloaded
            assert "reload_states() first" in r["refused"], where
            assert r["released"].get("optim_states", 0) > 0 and r["released"].get("lp_params", 0) > 0, where
            assert r["released"].get("hp_params", 0) > 0, where
            assert r["subset"] == ["optim_states"] and r["param_bytes"] > 0, where
            assert r["offloaded_after"] == [], where
        # stage 2 partitions gradients: its staging buffers are the contiguous gradient buffer
        assert res["2/False"]["released"].get("contiguous_grad_buffer", 0) > 0
        # AdamW keeps two fp32 moments per trainable element; ZeRO 1-3 hold this rank's half of them
        n = 12 * 32 + 32 + 32 * 6 + 6
        assert res["0/False"]["released"]["optim_states"] >= 2 * 4 * n
        assert res["2/False"]["released"]["optim_states"] < 2 * 4 * n


class _Kind(enum.Enum):  # DeepSpeed passes OffloadStateTypeEnum members
    hp_params = "hp_params"


def test_offload_states_arguments_and_refusals() -> None:
    from dscore.runtime.engine import EngineError

    engine, *_ = dscore.initialize(model=_model(), config=_config(0))
    _train(engine, 1, seed=0)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(EngineError, match="NVMe"):
        engine.offload_states(device="nvme")
    with pytest.raises(EngineError, match=r"unknown state type\(s\) \['hp_param'\]"):
        engine.offload_states(include=["hp_param"])
    engine.offload_states(device="none")  # a warning, nothing moved
    assert not engine.__dict__.get("_state_offloader")
    engine.offload_states(include=[_Kind.hp_params], non_blocking=True, pin_memory=False)
    with pytest.raises(EngineError, match="reload_states"):
        engine.step()
    engine.reload_states(non_blocking=True)
    after = engine.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
    cfg = _config(3, zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}})
    engine, *_ = dscore.initialize(model=_model(), config=cfg)
    with pytest.raises(EngineError, match="offload_param"):
        engine.offload_states()
    engine.close()
    cfg = _config(0)
    del cfg["optimizer"]
    engine, *_ = dscore.initialize(model=_model(), config=cfg)
    with pytest.raises(EngineError, match="needs an optimizer"):
        engine.offload_states()
    engine.close()
