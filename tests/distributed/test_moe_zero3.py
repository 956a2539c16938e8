"""MoE expert parallelism under ZeRO stage 3 on real gloo ranks (issue 32).

2 experts on 2 ranks (ep 2) and on 4 ranks (ep 2, two expert-data-parallel replicas) with
``drop_tokens=False`` equal a dense single-process loop within 1e-5: outputs, aux loss, the reduced
gradients (read from the stage's gradient partitions), every weight of the full model after 3 steps (both
experts, gathered under their global names), with and without gradient clipping, with parameters and
optimizer offloaded to the CPU, and with 2 micro steps per step at DeepSpeed's persistence threshold. ``stage3_param_persistence_threshold: 0`` makes every module gather and
release its parameters around each use, so the hooks, prefetch and the divergence fingerprint all run.
A ZeRO-3 checkpoint saved at ep 2 reloads at ep 2 and loads at ep 1 under stage 3 and stage 2, exactly.
The helpers (model, batches, dense loop) are the ZeRO 0-2 test's (``test_moe_expert_parallel``).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_moe_expert_parallel import AUX, NE, TOKENS, _batch, _dense, _models, _perturb

from dscore.testing import run_distributed

PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."


def _config(stage: int, clip: float, **zero: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": TOKENS,
        "zero_force_ds_cpu_optimizer": False,  # plain SGD with offload_optimizer (the reference's optimizer)
        "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 50, "reduce_bucket_size": 100, **zero},
    }  # fmt: skip


def _reduced_grads(stage) -> dict:
    """Full reduced gradients by module-local name (this rank's experts), from the gradient partitions
    (summed over each group's ranks, divided by the data-parallel world like the step does)."""
    from dscore.zero.layout import gather_by_name

    out = {}
    for key, layout in enumerate(stage.layouts):
        if stage.masters[key] is None:
            continue
        full = gather_by_name(stage.master_grads[key], layout, stage.group_comms[key])
        out.update({n: g / stage.world for n, g in full.items()})
    return out


def _run(clip: float, gas: int = 1, **zero: Any) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import dscore
    from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    ep = 2
    Net = _models()
    model = Net(ep)
    local_id = rank % ep
    _perturb(model.moe.deepspeed_moe.experts.deepspeed_experts[0], local_id)
    ref = Net(1)
    ref.moe = None
    experts = [copy.deepcopy(Net(ep).moe.deepspeed_moe.experts.deepspeed_experts[0]) for _ in range(NE)]
    for e, ex in enumerate(experts):
        _perturb(ex, e)
    ref_gate = torch.nn.Parameter(model.moe.deepspeed_moe.gate.wg.weight.detach().clone())
    ref_named = {f"inp.{n}": p for n, p in ref.inp.named_parameters()}
    ref_named["moe.deepspeed_moe.gate.wg.weight"] = ref_gate
    for e, ex in enumerate(experts):
        ref_named.update({f"{PREFIX}{e}.{n}": p for n, p in ex.named_parameters()})
    ref_named.update({f"out.{n}": p for n, p in ref.out.named_parameters()})
    ref_opt = torch.optim.SGD(list(ref_named.values()), lr=0.1)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    cfg = {**_config(3, clip, **zero), "gradient_accumulation_steps": gas}
    engine, *_ = dscore.initialize(model=model, model_parameters=groups, config=cfg)
    stage = engine.zero_stage_impl
    # the expert groups are the mesh's: the layer dispatches over its EP group, expert units live on its EDP group
    eg = engine.runtime.mesh.expert_groups(ep)
    assert model.moe.deepspeed_moe.ep_comm is eg.ep_comm
    assert all(s.unit.comm is eg.edp_comm for s in stage.units if ".deepspeed_experts." in stage.names[id(s.unit.params[0])])
    from dscore.parallel import groups as pg
    from dscore.runtime.context import use_runtime

    with use_runtime(engine.runtime):  # DeepSpeed's accessors, by group name
        assert (pg.get_expert_parallel_world_size("ep_size_2"), pg.get_expert_parallel_rank("ep_size_2")) == (2, rank % 2)
        assert pg.get_expert_data_parallel_world_size("ep_size_2") == world // 2
        assert pg.get_expert_data_parallel_rank("ep_size_2") == rank // 2
        assert dist.get_process_group_ranks(pg.get_expert_parallel_group("ep_size_2")) == eg.topology.ep_groups[rank // 2]
        assert dist.get_process_group_ranks(pg.get_expert_data_parallel_group("ep_size_2")) == eg.topology.edp_groups[rank % 2]
    # expert units live on the expert-data-parallel group (world / ep ranks), the rest on all ranks
    unit_worlds = {(".deepspeed_experts." in stage.names.get(id(s.unit.params[0]), "")): s.unit.world for s in stage.units}
    assert unit_worlds == {True: world // ep, False: world}, unit_worlds
    worst = {"out": 0.0, "aux": 0.0, "grad": 0.0, "weight": 0.0}

    def diff(a, b):
        return float((a.detach().float() - b.detach().float()).abs().max())

    for step in range(3):
        dense: dict[tuple[int, int], tuple] = {}  # (rank, micro step) -> (output, aux loss, target)
        for m in range(gas):
            for r in range(world):
                xr, yr = _batch(r, step * gas + m)
                dense[(r, m)] = (*_dense(xr, ref.inp, ref_gate, experts, ref.out), yr)
        ref_loss = sum(F.mse_loss(o, y) + AUX * a for o, a, y in dense.values()) / (world * gas)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref_named.items()}
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(ref_named.values()), clip)
        for m in range(gas):
            x, y = _batch(rank, step * gas + m)
            out, l_aux = engine(x)
            worst["out"] = max(worst["out"], diff(out, dense[(rank, m)][0]))
            worst["aux"] = max(worst["aux"], diff(l_aux, dense[(rank, m)][1]))
            engine.backward(F.mse_loss(out, y) + AUX * l_aux)
            if m < gas - 1:
                engine.step()  # not a boundary: no optimizer step
        grads = _reduced_grads(stage)  # accumulated over the window's micro steps
        assert len(grads) == len(ref_named) - (NE - NE // ep) * 4
        for name, g in grads.items():  # this rank's expert (local index 0) is global expert local_id
            gname = name.replace(f"{PREFIX}0.", f"{PREFIX}{local_id}.")
            worst["grad"] = max(worst["grad"], diff(g, ref_grads[gname]))
        engine.step()
        ref_opt.step()
        full = stage.module_state_dict()  # every expert, under its global name
        assert set(full) == set(ref_named), sorted(full)
        worst["weight"] = max(worst["weight"], max(diff(full[n], p) for n, p in ref_named.items()))
    engine.close()
    return worst


def _dropping(stage: int) -> dict:
    """4 experts on ep 2 (2 local experts per rank), top-2 gating with ``drop_tokens=True`` and capacity
    ceil(6 / 4 x 2 x 0.5) = 2 routes per expert (the rest dropped): the outputs, aux losses, expert counts
    and final weights (every expert) of 3 steps at ``stage``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import dscore
    from dscore.moe.layer import MoE
    from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank = dist.get_rank()
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = nn.ModuleDict({"moe": MoE(8, expert, num_experts=4, ep_size=2, k=2, capacity_factor=0.5, min_capacity=1,
                                      drop_tokens=True, use_rts=False)})  # fmt: skip
    for local, ex in enumerate(model["moe"].deepspeed_moe.experts.deepspeed_experts):
        _perturb(ex, 2 * (rank % 2) + local)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    engine, *_ = dscore.initialize(model=model, model_parameters=groups, config=_config(stage, 0.05))
    outs, auxes, counts = [], [], []
    for step in range(3):
        x, y = _batch(rank, step)
        out, l_aux, exp_counts = engine.module["moe"](x)
        engine.backward(F.mse_loss(out, torch.cat([y, y, y[:, :2]], dim=1)) + AUX * l_aux)
        engine.step()
        outs.append(out.detach())
        auxes.append(l_aux.detach())
        counts.append(exp_counts.tolist())
    full = engine.zero_stage_impl.module_state_dict()
    engine.close()
    return {"out": outs, "aux": auxes, "counts": counts, "weights": full}


def _dropping_stage3_vs_stage0() -> dict:
    a, b = _dropping(0), _dropping(3)
    worst = max(float((x - y).abs().max()) for k in ("out", "aux") for x, y in zip(a[k], b[k]))
    worst = max(worst, max(float((a["weights"][n] - b["weights"][n]).abs().max()) for n in a["weights"]))
    # top-2: 12 routes per rank over 4 experts of capacity 2: an expert over 2 had routes dropped
    return {"worst": worst, "counts": a["counts"], "same_counts": a["counts"] == b["counts"],
            "names": sorted(a["weights"]) == sorted(b["weights"])}  # fmt: skip


def _two_ranks() -> dict:
    return {
        "zero3": _run(0.0),
        "zero3-clip": _run(0.05),
        "zero3-offload-clip": _run(0.05, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}),
        # DeepSpeed's default threshold (every unit here is small: all stay gathered, refreshed after each
        # step) and 2 micro steps per step (expert gradient partitions accumulate)
        "zero3-persistent-gas2": _run(0.0, gas=2, stage3_param_persistence_threshold=100000),
    }


def _two_ranks_all() -> dict:
    return {"dense": _two_ranks(), "dropping": _dropping_stage3_vs_stage0()}


def _four_ranks() -> dict:
    return {"zero3-clip": _run(0.05)}


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for key, worst in res.items():
            for what, value in worst.items():
                assert value <= 1e-5, f"rank {rank} {key}: {what} differs by {value}"


def test_two_experts_on_two_ranks_at_zero3_equal_the_dense_loop() -> None:
    """Plus, in the same spawn, top-2 routing with ``drop_tokens=True`` (capacity below the load: routes
    dropped, the all-to-all at the fixed capacity) trains at stage 3 as at stage 0 (within 1e-6)."""
    results = run_distributed(_two_ranks_all, 2, timeout=300)
    _check([r["dense"] for r in results])
    for rank, r in enumerate(results):
        drop = r["dropping"]
        assert drop["names"] and drop["same_counts"], rank
        assert drop["worst"] <= 1e-6, f"rank {rank}: drop_tokens stage 3 vs stage 0 differs by {drop['worst']}"
        assert all(sum(c) == 12 for c in drop["counts"]) and any(max(c) > 2 for c in drop["counts"]), drop["counts"]


@pytest.mark.slow
def test_two_expert_replicas_on_four_ranks_at_zero3_equal_the_dense_loop() -> None:
    """ep 2 on 4 ranks: each expert is partitioned over its 2-rank expert-data-parallel group (gathered and
    reduce-scattered there); clipping's norm counts every expert chunk once over all ranks."""
    _check(run_distributed(_four_ranks, 4, timeout=400))


# ---------------------------------------------------------------------------------------------- checkpoints
def _engine(model, stage: int):
    import dscore
    from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer

    cfg = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    engine, *_ = dscore.initialize(model=model, model_parameters=groups, config=cfg)
    return engine


def _state(engine) -> dict:
    """Every weight and Adam exp_avg / exp_avg_sq by checkpoint (global) name, as lists."""
    state = engine.zero_stage_impl.state_dict()
    sd = engine.zero_stage_impl.module_state_dict()
    return {
        "weights": {k: v.tolist() for k, v in sd.items()},
        "exp_avg": {k: v["exp_avg"].tolist() for k, v in state["state"].items()},
        "exp_avg_sq": {k: v["exp_avg_sq"].tolist() for k, v in state["state"].items()},
    }


def _save_at_ep2(save_dir: str) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    model = _models()(2)
    _perturb(model.moe.deepspeed_moe.experts.deepspeed_experts[0], rank)
    engine = _engine(model, 3)
    for step in range(2):
        x, y = _batch(rank, step)
        out, l_aux = engine(x)
        engine.backward(F.mse_loss(out, y) + AUX * l_aux)
        engine.step()
    engine.save_checkpoint(save_dir, tag="ep2")
    saved = _state(engine)
    engine.close()
    engine2 = _engine(_models()(2), 3)
    engine2.load_checkpoint(save_dir, tag="ep2")
    again = _state(engine2)
    engine2.close()
    return {"saved": saved, "same_ep2": again == saved}


def _load_at_ep1(save_dir: str, stage: int) -> dict:
    engine = _engine(_models()(1), stage)
    engine.load_checkpoint(save_dir, tag="ep2")
    out = _state(engine)
    engine.close()
    return out


def test_zero3_checkpoint_saved_at_ep2_loads_at_ep1_under_stage3_and_stage2(tmp_path) -> None:
    results = run_distributed(_save_at_ep2, 2, str(tmp_path), timeout=300)
    assert all(r["same_ep2"] for r in results)
    saved = results[0]["saved"]
    assert saved == results[1]["saved"]
    w = saved["weights"]
    assert w[f"{PREFIX}0.0.weight"] != w[f"{PREFIX}1.0.weight"]  # both experts, each once
    assert {k for k in w if k.startswith(PREFIX)} == {f"{PREFIX}{e}.{i}.{t}" for e in range(NE) for i in (0, 2)
                                                      for t in ("weight", "bias")}  # fmt: skip
    loaded = run_distributed(_load_both, 1, str(tmp_path), timeout=120)[0]  # one process, every expert local
    for stage in (3, 2):
        assert loaded[stage] == saved, stage


def _load_both(save_dir: str) -> dict:
    return {stage: _load_at_ep1(save_dir, stage) for stage in (3, 2)}


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_zero3_with_experts_refuses_nvme_offload(key: str, tmp_path) -> None:
    import dscore
    from dscore.errors import ConfigError
    from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = _models()(1)
    cfg = _config(3, 0.0, **{key: {"device": "nvme", "nvme_path": str(tmp_path)}})
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}.device 'nvme' with MoE expert parameters"):
        dscore.initialize(model=model, model_parameters=groups, config=cfg)


def test_deepspeed_layout_save_of_an_moe_model_at_zero3_is_refused(tmp_path) -> None:
    from dscore.errors import CheckpointError

    engine = _engine(_models()(1), 3)  # stages 1-2 write DeepSpeed's MoE layout (tests/checkpoint_deepspeed)
    engine.checkpoint_layout = "deepspeed"
    with pytest.raises(CheckpointError, match="supported at ZeRO stages 1 and 2"):
        engine.save_checkpoint(str(tmp_path), tag="t")
    engine.close()
