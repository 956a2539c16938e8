"""Per-parameter accessors into ZeRO's partitioned state (``dscore.zero.fragments``, DeepSpeed's
``deepspeed.utils.safe_get_full_fp32_param`` & co.) at every stage, on 2 gloo ranks.

Each scenario trains a tiny model (parameters split across the ranks' chunks mid-parameter, one frozen
parameter) for two steps and compares, against a one-process reference (each rank's batch rows, gradients
averaged, torch AdamW on fp32 masters): the full gradient between backward and step, the fp32 masters and
AdamW's ``exp_avg``/``exp_avg_sq`` after the step, and the training after ``set_full_fp32_param`` /
``set_full_optimizer_state`` on every parameter (the module's weights follow at the step). The local
accessors' fragments, placed at their ``start``, must tile the full tensors exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dscore.testing import run_distributed

WORLD = 2
MICRO = 4
LR, WD = 1e-2, 0.01

# (label, stage, precision, extra zero_optimization keys)
SCENARIOS: list[tuple[str, int, str, dict[str, Any]]] = [
    ("stage0", 0, "fp32", {}),
    ("stage0-bf16", 0, "bf16", {}),
    ("stage1", 1, "fp32", {}),
    ("stage2", 2, "fp32", {}),
    ("stage2-bf16", 2, "bf16", {}),
    ("stage2-offload", 2, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    ("stage3", 3, "fp32", {}),
    ("stage3-bf16", 3, "bf16", {}),
    ("stage3-offload", 3, "bf16", {"offload_optimizer": {"device": "cpu"}}),
]


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model[2].bias.requires_grad_(False)  # frozen: no master, gradient or optimizer state
    return model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * MICRO, 5, generator=g), torch.randn(WORLD * MICRO, 3, generator=g)


def new_value(name: str, shape: torch.Size) -> torch.Tensor:
    """The value every rank (and the reference) writes into parameter ``name``'s master."""
    n = int(torch.Size(shape).numel())
    return torch.linspace(-0.4, 0.3 + 0.01 * len(name), n).view(shape)


def _np(t: torch.Tensor | None) -> Any:
    return None if t is None else t.detach().float().cpu().clone().numpy()


def _run(stage: int, precision: str, extra: dict[str, Any]) -> dict[str, Any]:
    import deepspeed.utils as dsu
    import torch.distributed as dist

    import dscore
    from dscore.errors import FragmentAccessError
    from dscore.zero import fragments as fr

    rank = dist.get_rank()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 30, "stage3_param_persistence_threshold": 0,
                              **extra},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    model = make_model()
    engine, *_ = dscore.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=config)
    named = list(engine.module.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [p for _, p in named if not p.requires_grad]
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    out: dict[str, Any] = {"steps": []}

    def local(p: torch.Tensor, values: torch.Tensor | None) -> Any:
        frag = fr.param_fragment(p)
        assert frag is not None and values is not None
        return frag.start, _np(values)

    for step in range(2):
        x, y = data(step)
        engine.backward(F.mse_loss(engine(x[rows].to(dtype)).float(), y[rows]))
        rec: dict[str, Any] = {
            "grad": {n: _np(fr.get_full_grad(p)) for n, p in trainable},
            "local_grad": {n: local(p, fr.get_local_grad(p)) for n, p in trainable},
            "compat_grad": {n: _np(dsu.safe_get_full_grad(p)) for n, p in trainable},
            "frozen_none": [fr.get_full_grad(p) is None and fr.get_full_fp32_param(p) is None for p in frozen],
        }
        engine.step()
        rec["fp32"] = {n: _np(fr.get_full_fp32_param(p)) for n, p in trainable}
        rec["compat_fp32"] = {n: _np(dsu.safe_get_full_fp32_param(p)) for n, p in trainable}
        rec["exp_avg"] = {n: _np(dsu.safe_get_full_optimizer_state(p, "exp_avg")) for n, p in trainable}
        rec["exp_avg_sq"] = {n: _np(fr.get_full_optimizer_state(p, "exp_avg_sq")) for n, p in trainable}
        rec["local_fp32"] = {n: local(p, dsu.safe_get_local_fp32_param(p)) for n, p in trainable}
        rec["local_exp_avg"] = {n: local(p, fr.get_local_optimizer_state(p, "exp_avg")) for n, p in trainable}
        if stage == 3:
            with dscore.zero.GatheredParameters([p for _, p in named]):
                rec["module"] = {n: _np(p) for n, p in named}
        else:
            rec["module"] = {n: _np(p) for n, p in named}
        try:
            fr.get_full_grad(trainable[0][1])
            rec["grad_after_step"] = "no error"
        except FragmentAccessError as exc:
            rec["grad_after_step"] = str(exc)
        try:
            dsu.safe_get_full_optimizer_state(trainable[0][1], "momentum_buffer")
            rec["bad_key"] = "no error"
        except FragmentAccessError as exc:
            rec["bad_key"] = str(exc)
        errors = []
        for call in (lambda: fr.set_full_fp32_param(trainable[0][1], torch.zeros(3)),
                     lambda: dsu.safe_set_full_fp32_param(frozen[0], torch.zeros(3)),
                     lambda: fr.set_local_fp32_param(trainable[0][1], torch.zeros(10_000))):
            try:
                call()
                errors.append("no error")
            except FragmentAccessError as exc:
                errors.append(str(exc))
        rec["set_errors"] = errors
        out["steps"].append(rec)
        if step == 0:  # every rank writes the same full values; the next step starts from them
            for n, p in trainable:
                shape = fr.param_fragment(p).shape  # type: ignore[union-attr]
                dsu.safe_set_full_fp32_param(p, new_value(n, shape))
                fr.set_full_optimizer_state(p, torch.full(shape, 0.05), "exp_avg")
    engine.close()
    return out


def _all() -> dict[str, Any]:
    return {label: _run(stage, precision, extra) for label, stage, precision, extra in SCENARIOS}


def reference(precision: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    """One process: per-rank gradients of the low-precision model averaged in fp32, AdamW on fp32 masters."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = make_model()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(masters.values()), lr=LR, weight_decay=WD)
    lp = copy.deepcopy(model).to(dtype)
    out = []
    for step in range(2):
        x, y = data(step)
        with torch.no_grad():
            for n, p in lp.named_parameters():
                if n in masters:
                    p.copy_(masters[n])
        grads = {n: torch.zeros_like(masters[n]) for n in names}
        for r in range(WORLD):
            lp.zero_grad()
            rows = slice(r * MICRO, (r + 1) * MICRO)
            F.mse_loss(lp(x[rows].to(dtype)).float(), y[rows]).backward()
            for n, p in lp.named_parameters():
                if n in grads:
                    grads[n] += p.grad.float() / WORLD
        for n in names:
            masters[n].grad = grads[n].clone()
        opt.step()
        rec = {
            "grad": grads,
            "fp32": {n: masters[n].detach().clone() for n in names},
            "exp_avg": {n: opt.state[masters[n]]["exp_avg"].clone() for n in names},
            "exp_avg_sq": {n: opt.state[masters[n]]["exp_avg_sq"].clone() for n in names},
        }
        out.append(rec)
        if step == 0:
            with torch.no_grad():
                for n in names:
                    masters[n].copy_(new_value(n, masters[n].shape))
                    opt.state[masters[n]]["exp_avg"].fill_(0.05)
    return out


def _close(got: Any, ref: torch.Tensor, precision: str, what: str) -> bool:
    g = torch.from_numpy(got)
    if g.shape != ref.shape:
        return False
    if precision == "bf16":  # bf16 forward/backward: rank sums rounded differently
        tol = {"exp_avg_sq": (1e-5, 5e-2)}.get(what, (3e-3, 3e-2))
        return torch.allclose(g, ref, atol=tol[0], rtol=tol[1])
    return torch.allclose(g, ref, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_fragment_accessors_match_a_single_process_reference_at_every_stage() -> None:
    results = run_distributed(_all, WORLD, timeout=600)
    refs = {p: reference(p) for p in ("fp32", "bf16")}
    bad: list[str] = []
    for label, stage, precision, _ in SCENARIOS:
        ref_steps = refs[precision]
        for rank, per_rank in enumerate(results):
            for k, (seen, ref) in enumerate(zip(per_rank[label]["steps"], ref_steps)):
                where = f"{label} rank {rank} step {k + 1}"
                for what in ("grad", "fp32", "exp_avg", "exp_avg_sq"):
                    for name, r in ref[what].items():
                        if not _close(seen[what][name], r, precision, what):
                            bad.append(f"{where}: {what}[{name}] off by "
                                       f"{(torch.from_numpy(seen[what][name]) - r).abs().max():.3g}")
                for what, full in (("compat_grad", "grad"), ("compat_fp32", "fp32")):
                    for name in ref[full]:
                        if not (seen[what][name] == seen[full][name]).all():
                            bad.append(f"{where}: deepspeed.utils {what} differs from dscore.zero.fragments")
                assert seen["frozen_none"] == [True], where
                assert "no reduced gradient is held now" in seen["grad_after_step"], (where, seen["grad_after_step"])
                assert "'momentum_buffer'" in seen["bad_key"] and "exp_avg" in seen["bad_key"], seen["bad_key"]
                wrong_size, frozen_set, wrong_local = seen["set_errors"]
                assert "'0.weight'" in wrong_size and "value has 3 elements" in wrong_size, wrong_size
                assert "frozen" in frozen_set, frozen_set
                assert "this rank holds" in wrong_local and "10000 elements" in wrong_local, wrong_local
                # the module's weights are the masters (in the compute dtype) right after the step
                for name, m in seen["fp32"].items():
                    lp = torch.from_numpy(seen["module"][name])
                    expect = torch.from_numpy(m).to(torch.bfloat16 if precision == "bf16" else torch.float32).float()
                    if not torch.equal(lp, expect):
                        bad.append(f"{where}: module weight {name} is not its fp32 master")
        # local fragments of both ranks tile the full tensors (partitioned stages: each rank a part)
        for k in range(2):
            for local_key, full_key in (("local_grad", "grad"), ("local_fp32", "fp32"), ("local_exp_avg", "exp_avg")):
                for name, full in results[0][label]["steps"][k][full_key].items():
                    flat = torch.from_numpy(full).reshape(-1)
                    covered = torch.zeros(flat.numel(), dtype=torch.int64)
                    for rank in range(WORLD):
                        start, vals = results[rank][label]["steps"][k][local_key][name]
                        vals = torch.from_numpy(vals)
                        covered[start : start + vals.numel()] += 1
                        if not torch.allclose(vals, flat[start : start + vals.numel()], atol=1e-7, rtol=1e-6):
                            bad.append(f"{label} rank {rank} step {k + 1}: {local_key}[{name}] is not its slice")
                    want = WORLD if stage == 0 else 1
                    if not (covered == want).all():
                        bad.append(f"{label} step {k + 1}: {local_key}[{name}] covers {covered.tolist()}")
                    sizes = [results[r][label]["steps"][k][local_key][name][1].size for r in range(WORLD)]
                    if stage != 0 and name == "0.weight" and min(sizes) == 0:  # split mid-parameter by the layout
                        bad.append(f"{label}: {local_key}[{name}] is not partitioned ({sizes})")
    assert not bad, f"{len(bad)} mismatches, e.g.:\n" + "\n".join(sorted({b.split(":")[0].split(" rank")[0] + ": " + b.split(": ",1)[1].split(" off")[0] for b in bad})[:60])
