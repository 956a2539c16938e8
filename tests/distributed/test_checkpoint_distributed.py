"""Checkpoints across real gloo ranks: N -> M world sizes for every ZeRO stage, agreement on errors."""

from __future__ import annotations

import os

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow

STAGES = (0, 1, 2, 3)


def _engine(stage: int, seed: int, extra: dict | None = None):
    import torch

    import dscore

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
    }
    config.update(extra or {})
    engine, *_ = dscore.initialize(model=model, config=config)
    return engine


def _train(engine, steps: int) -> None:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        loss = engine(torch.randn(2, 5, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def _snapshot(engine) -> dict:
    """Full module and optimizer state (world-size independent), detached to CPU."""
    import torch

    def cpu(x):  # tensors travel back as plain lists: torch's shared-memory pickling outlives no rank
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu")
            return (
                "tensor",
                str(t.dtype),
                tuple(t.shape),
                t.float().tolist() if t.dtype == torch.bfloat16 else t.tolist(),
            )
        if isinstance(x, dict):
            return {k: cpu(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(cpu(v) for v in x)
        return x

    return {
        "module": cpu(engine.zero_stage_impl.module_state_dict()),
        "optim": cpu(engine.zero_stage_impl.state_dict()),
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
    }


def _save_all(save_dir: str) -> dict:
    out = {}
    for stage in STAGES:
        engine = _engine(stage, seed=0)
        _train(engine, 4)
        engine.save_checkpoint(os.path.join(save_dir, f"stage{stage}"), client_state={"stage": stage})
        out[stage] = _snapshot(engine)
    return out


def _load_all(save_dir: str, stages: list[int]) -> dict:
    out = {}
    for stage in stages:
        engine = _engine(stage, seed=123)
        _, client = engine.load_checkpoint(os.path.join(save_dir, f"stage{stage}"))
        assert client == {"stage": stage}
        out[stage] = _snapshot(engine)
        _train(engine, 1)  # the restored state trains (partitions are consistent)
    return out


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("n_save, n_load", [(2, 1), (1, 2)])
def test_world_size_independence(tmp_path, n_save, n_load):
    saved = run_distributed(_save_all, n_save, str(tmp_path), timeout=300)
    reference = saved[0]
    for r in range(1, n_save):  # every saving rank saw the same gathered state
        _assert_same(reference, saved[r], f"save rank {r}")
    stages = sorted(reference)
    assert stages == [0, 1, 2, 3]
    loaded = run_distributed(_load_all, n_load, str(tmp_path), stages, timeout=300)
    for r, snap in enumerate(loaded):
        for stage in stages:
            _assert_same(reference[stage], snap[stage], f"stage {stage}, load rank {r} of {n_load}")


def _errors_agree(save_dir: str) -> dict:
    import torch.distributed as dist

    from dscore.errors import CheckpointError, CheckpointNotFoundError

    rank = dist.get_rank()
    seen = {}
    engine = _engine(1, seed=0, extra={"checkpoint": {"tag_validation": "FAIL"}})
    _train(engine, 1)
    try:
        engine.save_checkpoint(save_dir, tag=f"tag{rank}")
    except CheckpointError as exc:
        seen["fail"] = str(exc)
    seen["after_fail"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    dist.barrier()

    warn = _engine(1, seed=0)  # WARN (default): one checkpoint under rank 0's tag
    _train(warn, 1)
    warn.save_checkpoint(save_dir, tag=f"w{rank}")
    dist.barrier()
    seen["after_warn"] = sorted(os.listdir(save_dir))
    try:
        warn.save_checkpoint(save_dir, tag="bad", client_state={"x": object()} if rank == 1 else {"x": 1})
    except CheckpointError as exc:
        seen["unsafe"] = str(exc)
    try:
        warn.load_checkpoint(save_dir, tag="w0" if rank == 0 else "other")
    except CheckpointError as exc:
        seen["load_mismatch"] = str(exc)
    dist.barrier()
    if rank == 0:
        os.unlink(os.path.join(save_dir, "w0", "rank_00001_states.safetensors"))
    dist.barrier()
    try:
        warn.load_checkpoint(save_dir)
    except CheckpointNotFoundError as exc:
        seen["missing"] = str(exc)
    seen["final"] = sorted(os.listdir(save_dir))
    return seen


def test_errors_are_raised_on_every_rank(tmp_path):
    save_dir = str(tmp_path / "ck")
    results = run_distributed(_errors_agree, 2, save_dir, timeout=300)
    for rank, seen in enumerate(results):
        assert "tag0" in seen["fail"] and "tag1" in seen["fail"] and "FAIL" in seen["fail"], (rank, seen)
        assert seen["after_fail"] == [], "nothing may be written when tag validation fails"
        assert seen["after_warn"] == ["latest", "w0"], seen
        assert "rank 1" in seen["unsafe"] and "client_state['x']" in seen["unsafe"], seen["unsafe"]
        assert "rank 0: load_dir=" in seen["load_mismatch"] and "tag='other'" in seen["load_mismatch"]
        assert "rank_00001_states.safetensors" in seen["missing"] and "rank 1 of 2" in seen["missing"], seen["missing"]
        assert seen["final"] == ["latest", "w0"]
