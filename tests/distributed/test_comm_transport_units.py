"""The ``comm_transport`` units (issue 37): the facade takes its transports from the registry, asks them by
priority, and ``comm_transport:shm`` disabled (``DSCORE_DISABLE_PLUGINS`` or the config's ``plugins.disable``)
runs the same 2-rank jobs on gloo point-to-point with the same results; ``op_builder:shm_sync`` disabled
turns the shm transport off too; ``dscore plugins list --json`` shows the disabled unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from dscore.testing import run_distributed


def _collectives() -> dict[str, Any]:
    """Every facade collective a transport runs, next to torch.distributed's own result."""
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore.comm.transports import pick

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    got: dict[str, Any] = {}
    want: dict[str, Any] = {}
    x = torch.arange(7, dtype=torch.float32) * (rank + 1)
    ref = x.clone()
    dist.all_reduce(ref)
    y = x.clone()
    comm.all_reduce(y)
    got["sum"], want["sum"] = y.tolist(), ref.tolist()
    src = torch.arange(3, dtype=torch.float64) + rank
    refs = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(refs, src)
    flat = torch.empty(3 * world, dtype=torch.float64)
    comm.all_gather_into_tensor(flat, src)
    got["gather"], want["gather"] = flat.tolist(), torch.cat(refs).tolist()
    inp = torch.arange(2 * world, dtype=torch.float32) - rank
    full = inp.clone()
    dist.all_reduce(full)
    out = torch.empty(2)
    comm.reduce_scatter_tensor(out, inp, op="avg")
    got["rs_avg"], want["rs_avg"] = out.tolist(), (full[2 * rank : 2 * rank + 2] / world).tolist()
    chosen = {op: getattr(pick(None, True, [src], op=op, transports=comm.transports), "name", "native")
              for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return {"got": got, "want": want, "transports": [t.name for t in comm.transports], "chosen": chosen}


@pytest.mark.parametrize("disable", ["", "comm_transport:shm", "op_builder:shm_sync"])
def test_disabled_shm_runs_on_p2p_with_the_same_results(disable: str) -> None:
    results = run_distributed(_collectives, 2, timeout=180, env={"DSCORE_DISABLE_PLUGINS": disable})
    for res in results:
        assert res["got"] == res["want"]
    if not disable:
        assert results[0]["transports"] == ["shm", "p2p"]
        assert results[0]["chosen"] == {"all_reduce": "shm", "reduce_scatter": "shm", "all_gather": "shm"}
    else:
        assert results[0]["transports"] == ["p2p"]
        assert results[0]["chosen"] == {"all_reduce": "native", "reduce_scatter": "p2p", "all_gather": "p2p"}


def _train(disable: Sequence[str]) -> dict[str, Any]:
    """Two ZeRO-2 steps (reduce-scatters and all-gathers through the transports) with ``plugins.disable``."""
    import torch.distributed as dist

    import dscore
    from dscore.comm import Comm
    from dscore.runtime.context import use_runtime

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    config = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 30},
        "plugins": {"disable": list(disable)},
    }  # fmt: skip
    engine, *_ = dscore.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with use_runtime(engine.runtime):
        ad_hoc = [t.name for t in Comm(None, backend="gloo").transports]  # built inside: the runtime's registry
    out = {
        "losses": losses,
        "params": {k: v.detach().flatten().tolist() for k, v in engine.module_state_dict().items()},
        "transports": [t.name for t in engine.runtime.comm.transports],
        "ad_hoc": ad_hoc,
    }
    engine.close()
    return out


def _both() -> dict[str, Any]:
    return {"plain": _train([]), "no_shm": _train(["comm_transport:shm"])}


def test_config_disable_of_shm_trains_alike() -> None:
    results = run_distributed(_both, 2, timeout=240)
    for res in results:
        assert res["plain"]["transports"] == res["plain"]["ad_hoc"] == ["shm", "p2p"]
        assert res["no_shm"]["transports"] == res["no_shm"]["ad_hoc"] == ["p2p"]
        assert res["no_shm"]["losses"] == pytest.approx(res["plain"]["losses"], rel=1e-6, abs=1e-7)
        for name, want in res["plain"]["params"].items():
            assert res["no_shm"]["params"][name] == pytest.approx(want, rel=1e-6, abs=1e-7), name
    assert results[0]["no_shm"]["params"] == results[1]["no_shm"]["params"]


def test_plugins_list_shows_the_disabled_transport() -> None:
    env = {**os.environ, "DSCORE_DISABLE_PLUGINS": "comm_transport:shm"}
    proc = subprocess.run([sys.executable, "-m", "dscore", "plugins", "list", "--json"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    row = {r["name"]: r for r in json.loads(proc.stdout)}["comm"]
    assert row["status"] == "active"
    assert row["disabled_units"] == ["comm_transport:shm"]
    assert row["provides"]["comm_transport"] == ["p2p"]
    assert "shm_sync" in row["provides"]["op_builder"]  # only the transport unit is off
