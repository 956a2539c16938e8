"""Issue 15's failing inputs (part A), each as a focused test.

1. client optimizer with per-group settings and no ``model_parameters`` under ZeRO 1/2/3 (an ``lr = 0``
   group moved and the Adam step counter read 2 after one step);
2. client optimizer with an empty group plus a client ``LambdaLR`` under stages 0/2/3 (bare
   ``ValueError: zip() argument 2 is longer than argument 1``);
4. ZeRO-3 ``GatheredParameters(p, modifier_rank=None)`` with an in-place change on rank 0 only (ranks
   diverged);
plus ``zero_allow_untested_optimizer`` and ZeRO-3 without an optimizer.

The 2-rank checks run in ONE gloo job (``_all_two_rank_checks``); single-process checks run in-process.
"""

from __future__ import annotations

from typing import Any

import pytest

from dscore.testing import run_distributed

MICRO = 2


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2 * MICRO, 4, generator=g), torch.randn(2 * MICRO, 3, generator=g)
    return x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def _one_step(engine: Any) -> None:
    import torch.distributed as dist

    x, y = _batch(dist.get_rank())
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def _item1(stage: int) -> dict[str, Any]:
    import torch

    import dscore

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters(), "lr": 0.1}])
    engine, optimizer, _, _ = dscore.initialize(model=model, optimizer=opt, config=_config(stage))
    _one_step(engine)
    after = engine.zero_stage_impl.module_state_dict()
    return {
        "layer0_unchanged": all(torch.equal(after[k], before[k]) for k in ("0.weight", "0.bias")),
        "layer2_moved": not torch.equal(after["2.weight"], before["2.weight"]),
        "steps": sorted({int(float(s["step"])) for s in optimizer.state.values()}),
        "lr": engine.get_lr(),
        "same_object": optimizer is opt,
    }


def _item2(stage: int) -> dict[str, Any]:
    import torch

    import dscore

    model = _model()
    opt = torch.optim.AdamW(
        [{"params": []}, {"params": model[0].parameters(), "lr": 0.01}, {"params": model[2].parameters(), "lr": 0.1}]
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    engine, optimizer, _, lr_scheduler = dscore.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=_config(stage))
    _one_step(engine)
    _one_step(engine)
    return {
        "lr": engine.get_lr(),
        "scheduler_bound": lr_scheduler is sched and sched.optimizer is optimizer,
        "steps": sorted({int(float(s["step"])) for s in optimizer.state.values()}),
    }


def _item4() -> dict[str, Any]:
    """A persistent (always gathered) and a released unit, edited on rank 0 only inside a read-only
    context; values, the next forward and a training step must agree across ranks."""
    import torch
    import torch.distributed as dist

    import dscore

    model = _model()
    cfg = _config(3, optimizer={"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 30  # layer 2 (27 elements) stays gathered
    engine, *_ = dscore.initialize(model=model, config=cfg)
    original = {k: v.clone() for k, v in engine.zero_stage_impl.module_state_dict().items()}
    rank = dist.get_rank()
    persistent = model[2].weight
    released = model[0].weight
    assert engine.zero_stage_impl.units[0].unit.persistent is False
    assert engine.zero_stage_impl.units[1].unit.persistent is True
    with dscore.zero.GatheredParameters([persistent, released], modifier_rank=None):
        if rank == 0:
            with torch.no_grad():
                persistent.add_(1.0)
                released.mul_(3.0)
    after_ctx = engine.zero_stage_impl.module_state_dict()
    with torch.no_grad():
        out = engine(torch.ones(1, 4)).clone()
    _one_step(engine)
    return {
        "discarded": all(torch.equal(after_ctx[k], original[k]) for k in original),
        "live_persistent": persistent.detach().clone().numpy(),
        "forward": out.numpy(),
        "trained": {k: v.numpy() for k, v in engine.zero_stage_impl.module_state_dict().items()},
    }


def _item4_modifier_rank() -> dict[str, Any]:
    """The documented other branch: modifier_rank=0 keeps rank 0's change on every rank."""
    import torch
    import torch.distributed as dist

    import dscore

    model = _model()
    engine, *_ = dscore.initialize(
        model=model, config=_config(3, optimizer={"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}})
    )
    with dscore.zero.GatheredParameters(model[0].weight, modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                model[0].weight.fill_(0.25)
    return {"w": engine.zero_stage_impl.module_state_dict()["0.weight"].numpy()}


def _zero3_without_optimizer(tmp: str) -> dict[str, Any]:
    import torch

    import dscore

    model = _model()
    engine, optimizer, _, scheduler = dscore.initialize(model=model, config=_config(3))
    full = optimizer.state_dict()
    with optimizer.gathered_parameters(model[2].weight):
        gathered_shape = tuple(model[2].weight.shape)
    changed = {k: v + 1.0 for k, v in full.items()}
    optimizer.load_state_dict(changed)
    reloaded = optimizer.state_dict()
    engine.save_checkpoint(tmp, tag="t")
    optimizer.load_state_dict(full)
    engine.load_checkpoint(tmp, tag="t")
    restored = engine.zero_stage_impl.module_state_dict()
    with torch.no_grad():
        out = engine(torch.ones(1, 4))
    try:
        engine.backward(out.sum())
        refused = ""
    except Exception as exc:  # noqa: BLE001 - the type is checked by the test
        refused = type(exc).__name__ + ": " + str(exc)
    return {
        "type": type(optimizer).__name__,
        "lr": engine.get_lr(),
        "scheduler": scheduler,
        "gathered_shape": gathered_shape,
        "load_ok": all(torch.equal(reloaded[k], changed[k]) for k in changed),
        "ckpt_ok": all(torch.equal(restored[k], changed[k]) for k in changed),
        "refused": refused,
    }


def _all_two_rank_checks(tmp: str) -> dict[str, Any]:
    return {
        "item1": {s: _item1(s) for s in (1, 2, 3)},
        "item2": {s: _item2(s) for s in (0, 2, 3)},
        "item4": _item4(),
        "item4_modifier": _item4_modifier_rank(),
        "zero3_no_opt": _zero3_without_optimizer(tmp),
    }


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_all_two_rank_checks, 2, str(tmp_path_factory.mktemp("z3ckpt")), timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_item1_per_group_client_optimizer_without_model_parameters(two_rank: list[dict[str, Any]], stage: int) -> None:
    for res in (r["item1"][stage] for r in two_rank):
        assert res["layer0_unchanged"], "the lr=0 group moved"
        assert res["layer2_moved"]
        assert res["steps"] == [1], f"Adam step counters after one step: {res['steps']}"
        assert res["lr"] == [0.0, 0.1]
        assert res["same_object"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_item2_empty_group_with_client_scheduler(two_rank: list[dict[str, Any]], stage: int) -> None:
    for res in (r["item2"][stage] for r in two_rank):
        # LambdaLR(0.5 ** s) after two steps: every group at a quarter of its initial lr, empty group kept
        assert res["lr"] == pytest.approx([0.001 * 0.25, 0.01 * 0.25, 0.1 * 0.25])
        assert res["scheduler_bound"]
        assert res["steps"] == [2]


@pytest.mark.slow
def test_item4_read_only_gather_discards_changes_on_every_rank(two_rank: list[dict[str, Any]]) -> None:
    import numpy as np

    r0, r1 = (r["item4"] for r in two_rank)
    assert r0["discarded"] and r1["discarded"]
    np.testing.assert_array_equal(r0["live_persistent"], r1["live_persistent"])
    np.testing.assert_array_equal(r0["forward"], r1["forward"])
    for k in r0["trained"]:
        np.testing.assert_array_equal(r0["trained"][k], r1["trained"][k])


@pytest.mark.slow
def test_item4_modifier_rank_broadcasts(two_rank: list[dict[str, Any]]) -> None:
    import numpy as np

    for r in two_rank:
        np.testing.assert_array_equal(r["item4_modifier"]["w"], np.full((8, 4), 0.25, dtype=np.float32))


@pytest.mark.slow
def test_zero3_without_optimizer_returns_a_parameter_manager(two_rank: list[dict[str, Any]]) -> None:
    for res in (r["zero3_no_opt"] for r in two_rank):
        assert res["type"] == "Stage3ParameterManager"
        assert res["lr"] == [] and res["scheduler"] is None
        assert res["gathered_shape"] == (3, 8)
        assert res["load_ok"] and res["ckpt_ok"]
        assert res["refused"].startswith("EngineError") and "optimizer" in res["refused"]


# ---------------------------------------------------------------------------------------------- in-process
def test_untested_client_optimizer_under_zero_names_the_key() -> None:
    import torch

    import dscore
    from dscore.errors import ConfigError

    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        dscore.initialize(model=model, optimizer=sgd, config=_config(1))
    assert "zero_allow_untested_optimizer" in str(info.value) and "SGD" in str(info.value)
    # a callable's result is checked the same way
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        dscore.initialize(model=_model(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=_config(2))

    class MyAdam(torch.optim.Adam):
        pass

    model = _model()
    with pytest.raises(ConfigError, match="MyAdam"):
        dscore.initialize(model=model, optimizer=MyAdam(model.parameters()), config=_config(1))


def test_untested_client_optimizer_allowed_by_the_key_or_without_zero() -> None:
    import torch

    import dscore

    for cfg in (_config(1, zero_allow_untested_optimizer=True), _config(0)):
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, opt, _, _ = dscore.initialize(model=model, optimizer=sgd, config=cfg)
        assert opt is sgd
    model = _model()
    adagrad = torch.optim.Adagrad(model.parameters())
    assert dscore.initialize(model=model, optimizer=adagrad, config=_config(2))[1] is adagrad


def test_client_scheduler_bound_to_another_optimizer_is_refused() -> None:
    import torch

    import dscore
    from dscore.errors import ConfigError

    model = _model()
    other = torch.optim.AdamW(_model().parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0)
    cfg = _config(0, optimizer={"type": "AdamW", "params": {"lr": 0.01}})
    with pytest.raises(ConfigError, match="bound to a different optimizer"):
        dscore.initialize(model=model, lr_scheduler=sched, config=cfg)


def test_client_optimizer_over_foreign_tensors_names_the_group() -> None:
    import torch

    import dscore
    from dscore.errors import ConfigError

    model = _model()
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": [stray]}])
    with pytest.raises(ConfigError, match=r"param_groups\[1\]"):
        dscore.initialize(model=model, optimizer=opt, config=_config(0))
