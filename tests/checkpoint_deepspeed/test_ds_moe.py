"""DeepSpeed 0.19.8's MoE checkpoint layout (issue 38 item 7), written and read by the ``deepspeed`` layout.

* A script written for DeepSpeed (``import deepspeed``, ``deepspeed.moe.layer.MoE``, ep_size 2 on 2 gloo
  ranks, ZeRO 2) saves without a refusal; the directory holds exactly DeepSpeed's files and keys (the same
  as the real DeepSpeed checkpoint ``data/z2_moe_ep2``); a fresh engine that loads it trains on with the
  losses of the uninterrupted run.
* The same save loads at ep_size 1 (one process, every expert local): weights and Adam moments by global
  expert id equal the saving run's.
* The real DeepSpeed 0.19.8 MoE checkpoint ``data/z2_moe_ep2`` (see ``data/README.md``) loads at ep 2 on 2
  ranks and at ep 1: the module weights equal DeepSpeed's at the save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dscore.testing import run_distributed

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "z2_moe_ep2"
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."


def _net(ep_size: int):
    """The fixture's model (data/make_moe_fixture.py), built after ``torch.manual_seed(1234)``."""
    import torch
    from deepspeed.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=ep_size, k=2,
                           capacity_factor=4.0, min_capacity=8)  # fmt: skip
            self.out = torch.nn.Linear(8, 4)

        def forward(self, x):
            h, _, _ = self.moe(torch.relu(self.inp(x)))
            return self.out(h)

    torch.manual_seed(1234)
    return Net()


def _engine(ep_size: int, stage: int = 2):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = _net(ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8,
                                                     "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine


def _step(engine, step: int, rank: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def _global_view(engine) -> dict:
    """Every expert's weights and Adam moments by global name (dscore's stage state dicts), as lists."""
    state = engine.zero_stage_impl.state_dict()
    sd = engine.zero_stage_impl.module_state_dict()
    return {
        "weights": {k: v.tolist() for k, v in sd.items()},
        "exp_avg": {k: v["exp_avg"].tolist() for k, v in state["state"].items()},
    }


def _keys(path: str) -> dict:
    """File name -> its top-level keys (and, for optimizer files, what DeepSpeed's readers index)."""
    from dscore.checkpoint.deepspeed import safe_load  # DeepSpeed's pickles, read without running code

    out = {}
    for name in sorted(n for n in os.listdir(path) if n.endswith(".pt")):  # not dscore's _COMPLETE
        obj = safe_load(os.path.join(path, name))
        entry: dict = {"keys": sorted(obj)}
        if "optimizer_state_dict" in obj:
            osd = obj["optimizer_state_dict"]
            entry["partition_count"] = list(osd["partition_count"])
            entry["slices"] = [list(m) for m in osd["param_slice_mappings"]]
            entry["sizes"] = [int(t.numel()) for t in osd["single_partition_of_fp32_groups"]]
            # the hyper-parameters are the optimizer class's own (torch's AdamW here, DeepSpeed's there)
            entry["group_names"] = [(g.get("name"), g.get("moe")) for g in osd["base_optimizer_state"]["param_groups"]]
        elif "module" in obj:
            entry["module"] = list(obj["module"])
            entry["param_shapes"] = [list(g) for g in obj["param_shapes"]]
            entry["num_experts"] = obj["num_experts"]
        else:
            entry["entries"] = list(obj)
        out[name] = entry
    return out


def _save_and_resume(save_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    engine = _engine(2)
    for s in range(1, 4):
        _step(engine, s, rank)
    layout = engine.checkpoint_layout
    engine.save_checkpoint(save_dir, client_state={"epoch": 2})
    saved = _global_view(engine)
    torch.manual_seed(99)  # top-2 gating samples its second expert (Gumbel); DeepSpeed's layout has no RNG state
    straight = [_step(engine, s, rank) for s in (4, 5)]
    engine.close()
    fresh = _engine(2)
    path, client = fresh.load_checkpoint(save_dir)
    loaded = _global_view(fresh)
    torch.manual_seed(99)
    resumed = [_step(fresh, s, rank) for s in (4, 5)]
    steps = fresh.global_steps
    fresh.close()
    return {"layout": layout, "saved": saved, "loaded": loaded, "straight": straight, "resumed": resumed,
            "client": client, "steps": steps}  # fmt: skip


def _load_real(save_dir: str) -> dict:
    engine = _engine(2)
    engine.load_checkpoint(save_dir)
    out = _global_view(engine)
    engine.close()
    return out


def _load_at_ep1(save_dir: str) -> dict:
    engine = _engine(1)
    engine.load_checkpoint(save_dir)
    out = _global_view(engine)
    engine.close()
    return out


@pytest.mark.slow
def test_compat_moe_script_saves_deepspeed_layout_and_resumes(tmp_path) -> None:
    save = str(tmp_path / "ck")
    results = run_distributed(_save_and_resume, 2, save, timeout=300)
    r0 = results[0]
    assert r0["layout"] == "deepspeed"
    assert r0["client"]["epoch"] == 2 and r0["steps"] == 5
    tag = os.path.join(save, "global_step3")
    mine = _keys(tag)
    theirs = _keys(str(FIXTURE / "global_step3"))
    assert sorted(mine) == sorted(theirs)  # exactly DeepSpeed's file names
    for name in theirs:  # and DeepSpeed's keys, slices and partition sizes in each
        assert mine[name] == theirs[name], name
    for r in results:
        assert r["loaded"] == r["saved"]
        assert r["resumed"] == pytest.approx(r["straight"], abs=1e-6)
    # the same save at ep_size 1 (one process, all four experts local)
    one = _load_at_ep1(save)
    assert one["weights"] == r0["saved"]["weights"]
    assert one["exp_avg"] == r0["saved"]["exp_avg"]
    assert {k.split(PREFIX)[1].split(".")[0] for k in one["weights"] if PREFIX in k} == {"0", "1", "2", "3"}


def _close(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(torch.tensor(a[k]), torch.tensor(b[k]), atol=1e-6), k


@pytest.mark.slow
def test_real_deepspeed_moe_checkpoint_loads_at_ep2_and_ep1() -> None:
    with open(str(FIXTURE) + ".moe.json", encoding="utf-8") as f:
        want = json.load(f)["at_save"]
    results = run_distributed(_load_real, 2, str(FIXTURE), timeout=300)
    for r in results:
        _close(r["weights"], want)
        assert set(r["exp_avg"]) == set(want)  # every parameter's moments, experts by global id
    _close(_load_at_ep1(str(FIXTURE))["weights"], want)
