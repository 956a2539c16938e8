"""Collective arrival guard: a rank that never calls a collective engine API makes every rank that did
raise ``CollectiveArrivalError`` naming the method and the missing ranks (within DSCORE_ARRIVAL_TIMEOUT),
instead of hanging until the 10-minute collective timeout. Real gloo ranks on loopback."""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow

FAST = {"DSCORE_ARRIVAL_TIMEOUT": "3"}


def _engine(stage: int):
    import torch

    import dscore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    loss = engine(torch.ones(2, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def _call(engine, method: str, path: str):
    if method == "save_checkpoint":
        engine.save_checkpoint(path, tag="t")
    elif method == "load_checkpoint":
        engine.load_checkpoint(path, tag="t")
    elif method == "save_16bit_model":
        engine.save_16bit_model(path)
    else:
        from dscore.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            pass


def _only_some_call(methods: list[str], stage: int, callers: list[int], path: str):
    import time

    import torch.distributed as dist

    from dscore.comm.guard import CollectiveArrivalError

    engine = _engine(stage)
    if "load_checkpoint" in methods:
        engine.save_checkpoint(path, tag="t")  # every rank: something to load
    if dist.get_rank() not in callers:
        time.sleep(3 * len(methods) + 3)  # stay alive (and away) while the others wait
        return None
    results = []
    for method in methods:
        try:
            _call(engine, method, path)
        except CollectiveArrivalError as exc:
            results.append({"method": exc.method, "missing": exc.missing, "message": str(exc)})
        else:
            results.append({"method": None})
    return results


def test_rank0_only_save_checkpoint_names_the_method_and_the_missing_rank(tmp_path) -> None:
    """The issue's input: ZeRO stage 2, only rank 0 calls save_checkpoint."""
    out = run_distributed(_only_some_call, 2, ["save_checkpoint"], 2, [0], str(tmp_path), env=FAST, timeout=240)
    assert out[1] is None
    (result,) = out[0]
    assert result["method"] == "save_checkpoint", result
    assert result["missing"] == [1]
    assert "save_checkpoint" in result["message"] and "[1]" in result["message"]
    assert "DSCORE_ARRIVAL_TIMEOUT" in result["message"]
    assert not (tmp_path / "t").exists(), "nothing may be written when not every rank arrived"


def test_every_rank_that_arrived_raises(tmp_path) -> None:
    """Three ranks at ZeRO stage 3, rank 1 never calls: ranks 0 and 2 both raise for each API, naming [1]."""
    methods = ["load_checkpoint", "save_16bit_model", "GatheredParameters"]
    out = run_distributed(_only_some_call, 3, methods, 3, [0, 2], str(tmp_path), env=FAST, timeout=300)
    assert out[1] is None
    for rank in (0, 2):
        assert [r["method"] for r in out[rank]] == methods, out[rank]
        for result in out[rank]:
            assert result["missing"] == [1], result
            assert result["method"] in result["message"]


def _late_arrival(timeout_s: float):
    import time

    import torch.distributed as dist

    from dscore.comm.guard import CollectiveArrivalError, ensure_all_arrived

    if dist.get_rank() == 0:
        time.sleep(timeout_s + 3)  # arrives after rank 1 gave up
    try:
        ensure_all_arrived("save_checkpoint", timeout=timeout_s)
    except CollectiveArrivalError as exc:
        return {"missing": exc.missing, "arrived": exc.arrived, "message": str(exc)}
    return None


def test_a_rank_arriving_after_the_others_gave_up_raises_too() -> None:
    out = run_distributed(_late_arrival, 2, 2.0, timeout=120)
    assert out[1]["missing"] == [0]
    assert "after" in out[0]["message"] and out[0]["arrived"] == [1], out[0]


def _initialize_on_rank0_only():
    import time

    import torch.distributed as dist

    from dscore.comm.guard import CollectiveArrivalError

    if dist.get_rank() == 1:
        time.sleep(5)
        return None
    try:
        _engine(0)
    except CollectiveArrivalError as exc:
        return {"method": exc.method, "missing": exc.missing}
    return {"method": None}


def test_initialize_not_called_by_every_rank_of_an_existing_group() -> None:
    out = run_distributed(_initialize_on_rank0_only, 2, env=FAST, timeout=120)
    assert out[0] == {"method": "initialize", "missing": [1]}


def _all_arrive_repeatedly(path: str):
    import torch.distributed as dist

    from dscore.comm.guard import ensure_all_arrived

    engine = _engine(1)
    engine.save_checkpoint(path, tag="a")
    engine.save_checkpoint(path, tag="b")
    for _ in range(20):
        ensure_all_arrived("probe", timeout=60)
    dist.barrier()  # the last arriver deletes after releasing the others: let it finish
    store = dist.distributed_c10d._get_default_store()
    # the last arriver of call #20 deleted call #19's keys; call #20's stay until call #21
    return store.check(["dscore/arrival/probe/19/count"]), store.check(["dscore/arrival/probe/20/count"])


def test_fast_path_when_every_rank_arrives_and_old_keys_are_deleted(tmp_path) -> None:
    out = run_distributed(_all_arrive_repeatedly, 2, str(tmp_path), timeout=180)
    assert out == [(False, True), (False, True)]
    assert (tmp_path / "b").is_dir()


def test_malformed_timeout_variable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore.comm.guard import arrival_timeout
    from dscore.errors import DistributedError

    assert arrival_timeout({}) == 120.0
    assert arrival_timeout({"DSCORE_ARRIVAL_TIMEOUT": "0"}) == 0.0
    with pytest.raises(DistributedError, match="DSCORE_ARRIVAL_TIMEOUT='soon'"):
        arrival_timeout({"DSCORE_ARRIVAL_TIMEOUT": "soon"})
    with pytest.raises(DistributedError, match=">= 0"):
        arrival_timeout({"DSCORE_ARRIVAL_TIMEOUT": "-5"})
