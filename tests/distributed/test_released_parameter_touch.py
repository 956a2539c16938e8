"""Issue 33 item 4 (remainder): touching a released ZeRO-3 parameter outside any gather.

After ``dscore.zero.Init`` (before ``dscore.initialize``) and after ``initialize`` (outside forward and
``GatheredParameters``) a partitioned parameter keeps its full shape over 0 bytes of storage. Before this
change ``p.sum()``, ``p.clone()``, ``p.fill_()``, ``print(p)``, ``p * 2``, ``p.data.sum()`` and
``F.linear(x, p)`` read or wrote unowned memory: SIGSEGV. Now each raises
``dscore.errors.PartitionedParameterError`` naming the parameter and ``GatheredParameters``, on every rank,
with no collective (a rank-0-only touch must not hang the others); metadata reads, a no-op ``.to``,
``GatheredParameters`` and training keep working. Ranks are real gloo processes, so a segfault kills a
rank and fails the test instead of the pytest process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscore.testing import run_distributed

TOUCHES = ["sum", "clone", "fill_", "print", "mul", "data.sum", "linear"]


def _touch(kind: str, p: torch.Tensor) -> Any:
    x = torch.ones(2, p.shape[-1], device=p.device)
    if kind == "sum":
        return p.sum()
    if kind == "clone":
        return p.clone()
    if kind == "fill_":
        with torch.no_grad():
            return p.fill_(0.5)
    if kind == "print":
        print(p)
        return None
    if kind == "mul":
        return p * 2
    if kind == "data.sum":
        return p.data.sum()
    return torch.nn.functional.linear(x, p)


def _try_all(p: torch.Tensor) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for kind in TOUCHES:
        try:
            _touch(kind, p)
            out[kind] = ("no error", "")
        except Exception as e:  # the type and text are what the test checks
            out[kind] = (type(e).__name__, str(e))
    return out


def _scenario() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore
    from dscore.zero.partition import unit_of

    rank = dist.get_rank()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 5)
            self.head = torch.nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.lin(x)))

    torch.manual_seed(0)
    with dscore.zero.Init():
        model = Net()
    w = model.lin.weight
    res: dict[str, Any] = {"released_after_init": not unit_of(w).gathered}
    res["before_initialize"] = _try_all(w)
    # metadata and no-op conversions read nothing and stay allowed
    res["meta"] = (tuple(w.shape), w.numel(), w.dtype == torch.float32, w.requires_grad, w.grad is None)
    res["noop_to"] = w.to(w.device) is w and w.to(torch.float32) is w
    model.to("cpu")  # Module._apply with a no-op conversion (HF Trainer and user scripts do this)
    res["module_repr"] = "Linear(in_features=6" in repr(model)
    with dscore.zero.GatheredParameters(w):
        res["gathered_sum"] = float(w.detach().sum())
        res["gathered_type"] = type(w).__name__

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = dscore.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g)[rank * 2 : rank * 2 + 2]
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    w = engine.module.lin.weight
    res["released_after_step"] = not unit_of(w).gathered
    res["after_initialize"] = _try_all(w)
    # a touch on one rank only must raise there and not start a collective the other rank never joins
    if rank == 0:
        res["rank0_only"] = _try_all(engine.module.head.bias)["sum"][0]
    loss2 = engine(x).pow(2).mean()  # training still runs after the refused touches
    engine.backward(loss2)
    engine.step()
    res["loss"] = float(loss2)
    with dscore.zero.GatheredParameters(list(engine.module.parameters())):
        res["values"] = {n: p.detach().clone().numpy() for n, p in engine.module.named_parameters()}
    res["state_dict_keys"] = sorted(engine.module_state_dict())
    return res


def test_touching_a_released_parameter_raises_a_named_error_not_a_segfault() -> None:
    r0, r1 = run_distributed(_scenario, 2, timeout=300)
    for r in (r0, r1):
        assert r["released_after_init"] and r["released_after_step"]
        for phase in ("before_initialize", "after_initialize"):
            for kind in TOUCHES:
                err, msg = r[phase][kind]
                assert err == "PartitionedParameterError", (phase, kind, err, msg)
                assert "'lin.weight'" in msg and "dscore.zero.GatheredParameters" in msg, (phase, kind, msg)
        assert "Tensor.data (read)" in r["before_initialize"]["data.sum"][1]
        assert "torch.nn.functional.linear" in r["after_initialize"]["linear"][1]
        assert r["meta"] == ((5, 6), 30, True, True, True)
        assert r["noop_to"] and r["module_repr"]
        assert r["gathered_type"] == "Parameter"
        assert r["state_dict_keys"] == ["head.bias", "head.weight", "lin.bias", "lin.weight"]
    assert r0["rank0_only"] == "PartitionedParameterError"
    assert r0["gathered_sum"] == r1["gathered_sum"]
    ref = _reference_second_loss()
    assert r0["loss"] == pytest.approx(ref[0], rel=1e-5) and r1["loss"] == pytest.approx(ref[1], rel=1e-5)
    for name, v in r0["values"].items():
        assert (v == r1["values"][name]).all(), name


def _reference_second_loss() -> list[float]:
    """Rank losses of the second step of plain PyTorch data-parallel SGD (mean of the ranks' gradients)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        losses = [model(x[r * 2 : r * 2 + 2]).pow(2).mean() for r in range(2)]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    return [float(v.detach()) for v in losses]
