"""Engine lifecycle: ``engine.close()`` / ``with engine:`` release the engine's lease on dscore's process
group; the group dscore created for ``initialize`` ends with the last engine on it; a group created by an
explicit ``dscore.init_distributed()`` lives until exit; a group the user created is never destroyed."""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def _engine():
    import torch

    import dscore

    model = torch.nn.Linear(3, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = dscore.initialize(model=model, config=config)
    loss = engine(torch.ones(2, 3)).sum()
    engine.backward(loss)
    engine.step()
    return engine


def _scenario(kind: str):
    import torch.distributed as dist

    import dscore
    from dscore.comm.init import PROCESS_GROUP_OWNER

    seen = []
    if kind == "dscore_created":
        first = _engine()
        second = _engine()  # reuses the group the first initialize created
        first.close()
        seen.append(dist.is_initialized())  # second still holds it
        first.close()  # idempotent: no second release
        seen.append(dist.is_initialized())
        with second:
            pass
        seen.append(dist.is_initialized())  # last engine closed: dscore's group is gone
    elif kind == "explicit_init":
        dscore.init_distributed()
        with _engine():
            pass
        seen.append(dist.is_initialized())  # the explicit call's group lives on
        PROCESS_GROUP_OWNER.destroy_at_exit()
        seen.append(dist.is_initialized())  # ... until exit
    else:  # the harness created the group: the user's
        engine = _engine()
        engine.close()
        seen.append(dist.is_initialized())
        PROCESS_GROUP_OWNER.destroy_at_exit()
        seen.append(dist.is_initialized())
        engine.destroy()
        seen.append(dist.is_initialized())
    return seen


def test_group_created_by_initialize_ends_with_the_last_engine() -> None:
    out = run_distributed(_scenario, 2, "dscore_created", init_process_group=False, timeout=180)
    assert out == [[True, True, False]] * 2


def test_group_from_explicit_init_distributed_lives_until_exit() -> None:
    out = run_distributed(_scenario, 2, "explicit_init", init_process_group=False, timeout=180)
    assert out == [[True, False]] * 2


def test_user_created_group_is_never_destroyed() -> None:
    out = run_distributed(_scenario, 2, "user", timeout=180)
    assert out == [[True, True, True]] * 2


def test_close_flushes_monitors_once(tmp_path) -> None:
    out = run_distributed(_close_with_monitor, 2, str(tmp_path), init_process_group=False, timeout=180)
    assert out[0] == (True, 0)


def _close_with_monitor(path: str):
    import torch
    import torch.distributed as dist

    import dscore

    model = torch.nn.Linear(3, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": path, "job_name": "j"},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    loss = engine(torch.ones(2, 3)).sum()
    engine.backward(loss)
    engine.step()
    rank = dist.get_rank()
    had = bool(engine.monitors) if rank == 0 else True
    engine.close()
    engine.close()
    return had, len(engine.monitors)
