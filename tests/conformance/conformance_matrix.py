"""Cases, models and the single-process PyTorch reference of the optimizer-structure conformance matrix.

A case is a dict of factor values (see :data:`FACTORS`). :func:`run_cases` runs a list of cases on one
rank of a 2-rank gloo job (every rank runs the same list, in order) and returns, per case, either the
measurements or the error text; :func:`reference` computes the same measurements in one process with
plain ``torch.optim.AdamW`` (and, for bf16, a bf16 model with fp32 master weights, as the engine does).

What every case checks after ``STEPS`` optimizer steps with ``GAS`` micro-batches each and gradient
clipping: the module's parameters, the Adam step count of every optimizer state entry, the per-group lr
the engine reports after every step (``engine.get_lr()``), and that parameters of an ``lr = 0`` group
did not move at all.
"""

from __future__ import annotations

import itertools
from typing import Any

IN, HID, OUT = 5, 6, 3
MICRO, GAS, STEPS, WORLD = 2, 2, 3, 2
CLIP = 0.05
BASE_LR, BASE_WD = 0.02, 0.01

FACTORS: dict[str, tuple[Any, ...]] = {
    "stage": (0, 1, 2, 3),
    "offload": ("none", "cpu"),
    "precision": ("fp32", "bf16"),
    # where the optimizer comes from and whether model_parameters is passed
    "source": (
        "config", "config_groups", "client_flat", "client_flat_mp", "client_groups", "client_groups_mp", "callable",
    ),
    "shape": ("single", "per_group", "empty", "frozen", "one_element", "zero_size", "tied"),
    "scheduler": ("none", "config", "client"),
}


def allowed(case: dict[str, Any]) -> bool:
    """Combinations that exist: optimizer offload needs a partitioning stage (1-3)."""
    return not (case.get("offload") == "cpu" and case.get("stage") == 0)


def pairwise_cases() -> list[dict[str, Any]]:
    """A deterministic greedy covering array: every allowed pair of factor values appears in some case.

    Greedy (AETG-like, without randomness): repeatedly take the first uncovered pair, then fill the other
    factors with the value covering the most still-uncovered pairs.
    """
    names = list(FACTORS)
    uncovered: set[tuple[tuple[str, Any], tuple[str, Any]]] = set()
    for a, b in itertools.combinations(names, 2):
        for va in FACTORS[a]:
            for vb in FACTORS[b]:
                if allowed({a: va, b: vb}):
                    uncovered.add(((a, va), (b, vb)))
    cases: list[dict[str, Any]] = []

    def gain(case: dict[str, Any]) -> int:
        items = sorted(case.items(), key=lambda kv: names.index(kv[0]))
        return sum(1 for x, y in itertools.combinations(items, 2) if (x, y) in uncovered)

    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), repr(p)))
        case: dict[str, Any] = {a: va, b: vb}
        for n in names:
            if n in case:
                continue
            best, best_gain = None, -1
            for v in FACTORS[n]:
                trial = {**case, n: v}
                if not allowed(trial):
                    continue
                g = gain(trial)
                if g > best_gain:
                    best, best_gain = v, g
            case[n] = best
        items = sorted(case.items(), key=lambda kv: names.index(kv[0]))
        for x, y in itertools.combinations(items, 2):
            uncovered.discard((x, y))
        cases.append(case)
    return cases


# The issue's failing inputs, always in the matrix (items 1 and 2 of issue 15).
ISSUE_CASES: list[dict[str, Any]] = [
    *(
        {"stage": s, "offload": "none", "precision": "fp32", "source": "client_groups", "shape": "per_group",
         "scheduler": "none"}
        for s in (1, 2, 3)
    ),
    *(
        {"stage": s, "offload": "none", "precision": "fp32", "source": "client_groups", "shape": "empty",
         "scheduler": "client"}
        for s in (0, 2, 3)
    ),
]


def all_cases() -> list[dict[str, Any]]:
    """The pairwise cases followed by the issue's inputs not already present."""
    cases = pairwise_cases()
    for c in ISSUE_CASES:
        if c not in cases:
            cases.append(c)
    return cases


def case_id(case: dict[str, Any]) -> str:
    return "-".join(f"{case[k]}" for k in FACTORS)


# ---------------------------------------------------------------------------------------------------
# model, groups, data
# ---------------------------------------------------------------------------------------------------
def make_model(shape: str) -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(IN, HID)
            self.mid = nn.Linear(HID, HID)
            self.out = nn.Linear(HID, OUT)
            self.scale = nn.Parameter(torch.full((1,), 1.1))
            self.empty = nn.Parameter(torch.zeros(0)) if shape == "zero_size" else None
            if shape == "tied":
                self.back = nn.Linear(HID, HID)
                self.back.weight = self.mid.weight  # one Parameter used by two modules

        def forward(self, x: Any) -> Any:
            h = torch.tanh(self.inp(x))
            h = torch.tanh(self.mid(h)) * self.scale
            if shape == "tied":
                h = h + torch.tanh(self.back(h))
            if self.empty is not None:
                h = h + self.empty.sum()
            return self.out(h)

    torch.manual_seed(0)
    model = Net()
    if shape == "frozen":
        for p in model.inp.parameters():
            p.requires_grad_(False)
    return model


def group_specs(model: Any, shape: str) -> list[dict[str, Any]]:
    """Per-group dicts (hyper-parameters differ per group) for the grouped sources."""
    m = model
    if shape == "single":
        return [{"params": list(m.parameters())}]
    if shape == "per_group":  # issue item 1: an lr=0 group must not move
        return [
            {"params": list(m.inp.parameters()), "lr": 0.0},
            {"params": [*m.mid.parameters(), m.scale], "lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.99)},
            {"params": list(m.out.parameters()), "eps": 1e-6, "weight_decay": 0.0},
        ]
    if shape == "empty":  # issue item 2
        return [
            {"params": []},
            {"params": [*m.inp.parameters(), *m.mid.parameters()], "lr": 0.01},
            {"params": [*m.out.parameters(), m.scale], "lr": 0.1},
        ]
    if shape == "frozen":
        return [
            {"params": list(m.inp.parameters()), "lr": 0.3},
            {"params": [*m.mid.parameters(), *m.out.parameters(), m.scale]},
        ]
    if shape == "one_element":
        return [
            {"params": [m.scale], "lr": 0.2, "weight_decay": 0.0},
            {"params": [*m.inp.parameters(), *m.mid.parameters(), *m.out.parameters()]},
        ]
    if shape == "zero_size":
        return [
            {"params": [m.empty], "lr": 0.5},
            {"params": [*m.inp.parameters(), *m.mid.parameters(), *m.out.parameters(), m.scale], "lr": 0.03},
        ]
    if shape == "tied":
        return [
            {"params": [m.mid.weight], "lr": 0.04, "betas": (0.85, 0.98)},
            {"params": [p for n, p in m.named_parameters() if n != "mid.weight"]},
        ]
    raise ValueError(shape)


def grouped(case: dict[str, Any]) -> bool:
    return case["source"] in ("config_groups", "client_groups", "client_groups_mp", "callable")


def data() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    n = MICRO * WORLD * GAS * STEPS
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def lr_lambdas(n_groups: int) -> list[Any]:
    # one lambda per group (a list: LambdaLR zips it with the groups, the issue's failure mode)
    return [(lambda s, k=k: 1.0 / (1.0 + 0.5 * s * (k + 1))) for k in range(n_groups)]


STEP_LR = {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}


# ---------------------------------------------------------------------------------------------------
# engine side (runs on each rank)
# ---------------------------------------------------------------------------------------------------
def _engine_config(case: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": case["stage"],
            "reduce_bucket_size": 40,
            "allgather_bucket_size": 40,
            "stage3_param_persistence_threshold": 10,
        },
    }
    if case["offload"] == "cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch.optim.AdamW stepping CPU partitions
    if case["precision"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case["source"].startswith("config"):
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": BASE_LR, "weight_decay": BASE_WD, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True},
        }
    if case["scheduler"] == "config":
        cfg["scheduler"] = STEP_LR
    return cfg


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Train one case on this rank; return the measurements (parameters by name, step counts, lrs)."""
    import torch
    import torch.distributed as dist

    import dscore

    model = make_model(case["shape"])
    kwargs: dict[str, Any] = {"model": model, "config": _engine_config(case)}
    src = case["source"]
    groups = group_specs(model, case["shape"]) if grouped(case) else None
    if src == "config_groups":
        kwargs["model_parameters"] = groups
    elif src == "callable":  # optimizer=callable(param_groups) with the groups as model_parameters
        kwargs["model_parameters"] = groups
        kwargs["optimizer"] = lambda gs: torch.optim.AdamW(gs, lr=BASE_LR, weight_decay=BASE_WD)
    elif src in ("client_flat", "client_flat_mp"):
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=BASE_WD)
        if src == "client_flat_mp":
            kwargs["model_parameters"] = model.parameters()
    elif src in ("client_groups", "client_groups_mp"):
        assert groups is not None
        kwargs["optimizer"] = torch.optim.AdamW(groups, lr=BASE_LR, weight_decay=BASE_WD)
        if src == "client_groups_mp":
            kwargs["model_parameters"] = group_specs(model, case["shape"])
    if case["scheduler"] == "client":
        if isinstance(kwargs.get("optimizer"), torch.optim.Optimizer):
            opt = kwargs["optimizer"]
            kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambdas(len(opt.param_groups)))
        else:  # config optimizer: the scheduler can only be a callable over the engine's optimizer
            kwargs["lr_scheduler"] = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_lambdas(len(o.param_groups)))
    engine, optimizer, _, _ = dscore.initialize(**kwargs)
    rank = dist.get_rank()
    x, y = data()
    dtype = torch.bfloat16 if case["precision"] == "bf16" else torch.float32
    lrs: list[list[float]] = []
    span = MICRO * WORLD
    for k in range(GAS * STEPS):
        rows = slice(k * span + rank * MICRO, k * span + (rank + 1) * MICRO)
        out = engine(x[rows].to(dtype))
        loss = ((out.float() - y[rows]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied():
            lrs.append(engine.get_lr())
    steps = sorted(
        {int(float(s["step"])) for s in optimizer.state.values() if "step" in s}
    )
    state = engine.zero_stage_impl.module_state_dict()
    return {
        # numpy, not tensors: tensors crossing the result queue would need the sender alive
        "params": {k: v.detach().float().numpy().copy() for k, v in state.items()},
        "steps": steps,
        "lrs": lrs,
        "global_steps": engine.global_steps,
        "n_groups": len(optimizer.param_groups),
    }


def run_cases(cases: list[dict[str, Any]]) -> list[Any]:
    """Run every case in order on this rank; an exception becomes ``"ERROR: ..."`` for that case."""
    import traceback

    out: list[Any] = []
    for case in cases:
        try:
            out.append(run_case(case))
        except Exception:  # noqa: BLE001 - reported per case by the test
            out.append("ERROR: " + traceback.format_exc(limit=6))
    return out


# ---------------------------------------------------------------------------------------------------
# single-process PyTorch reference
# ---------------------------------------------------------------------------------------------------
def reference(case: dict[str, Any]) -> dict[str, Any]:
    """Plain PyTorch: the global batch of every micro step in one process, AdamW, clip_grad_norm_.

    bf16: the model computes in bf16, gradients are summed in fp32 over the window, AdamW steps fp32
    master copies that are copied back into the bf16 model (what the engine does, without the
    cross-rank averaging, whose rounding the bf16 tolerance covers).
    """
    import torch

    model = make_model(case["shape"])
    bf16 = case["precision"] == "bf16"
    names = {id(p): n for n, p in model.named_parameters()}
    if grouped(case):
        groups = group_specs(model, case["shape"])
    else:
        groups = [{"params": list(model.parameters())}]
    hyper = {"lr": BASE_LR, "weight_decay": BASE_WD}
    if bf16:
        lp = make_model(case["shape"]).to(torch.bfloat16)
        lp_by_name = dict(lp.named_parameters())
        masters = {id(p): torch.nn.Parameter(p.detach().clone().float()) for p in model.parameters()}
        opt_groups = [
            {**g, "params": [masters[id(p)] for p in g["params"] if p.requires_grad]} for g in groups
        ]
    else:
        lp = model
        opt_groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    opt = torch.optim.AdamW(opt_groups, **hyper)
    sched: Any = None
    if case["scheduler"] == "config":
        sched = torch.optim.lr_scheduler.StepLR(opt, **STEP_LR["params"])
    elif case["scheduler"] == "client":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambdas(len(opt.param_groups)))
    trainable = [p for g in opt_groups for p in g["params"]]
    x, y = data()
    dtype = torch.bfloat16 if bf16 else torch.float32
    span = MICRO * WORLD
    lrs: list[list[float]] = []
    for s in range(STEPS):
        acc = {id(p): torch.zeros_like(p, dtype=torch.float32) for p in trainable}
        for m in range(GAS):
            k = s * GAS + m
            rows = slice(k * span, (k + 1) * span)
            lp.zero_grad(set_to_none=True)
            out = lp(x[rows].to(dtype))
            loss = ((out.float() - y[rows]) ** 2).mean() / GAS
            loss.backward()
            if bf16:
                for p in model.parameters():
                    if p.requires_grad:
                        g = lp_by_name[names[id(p)]].grad
                        if g is not None:
                            acc[id(masters[id(p)])] += g.float()
            else:
                for p in trainable:
                    if p.grad is not None:
                        acc[id(p)] += p.grad
        for p in trainable:
            p.grad = acc[id(p)]
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        if sched is not None:
            sched.step()
        lrs.append([float(g["lr"]) for g in opt.param_groups])
        if bf16:
            with torch.no_grad():
                for p in model.parameters():
                    lp_by_name[names[id(p)]].copy_(masters[id(p)])
    final = lp if bf16 else model
    params = {k: v.detach().float().clone() for k, v in final.state_dict().items()}
    steps = sorted({int(float(st["step"])) for st in opt.state.values() if "step" in st})
    return {"params": params, "steps": steps, "lrs": lrs, "n_groups": len(opt.param_groups)}
