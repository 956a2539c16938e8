"""Shared helpers for the DeepSpeed-checkpoint tests: the fixtures' models, data rule and a rank worker.

The fixtures (``../shared/fixtures/deepspeed-0.19.8-checkpoints``) were trained by DeepSpeed 0.19.8; each
``<name>.expected.json`` records the parameters after steps 4 and 5 that a faithful loader reproduces
when it resumes from the step-3 checkpoint with the same data (see the fixtures' README).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "deepspeed-0.19.8-checkpoints"
DATA = Path(__file__).resolve().parent / "data"
MICRO = 4


def fixture_names() -> list[str]:
    """Fixture folders that have an ``expected.json`` (empty when the shared dir is absent)."""
    if not FIXTURES.is_dir():
        return []
    return sorted(p.name[: -len(".expected.json")] for p in FIXTURES.glob("*.expected.json"))


def extra_paths() -> list[str]:
    """The committed extra DeepSpeed checkpoints in ``data/`` (see its README)."""
    return sorted(str(p)[: -len(".expected.json")] for p in DATA.glob("*.expected.json"))


def expected(path: str) -> dict[str, Any]:
    with open(path + ".expected.json", encoding="utf-8") as f:
        return json.load(f)


def make_model(kind: str) -> Any:
    """The fixture's model, constructed after ``torch.manual_seed(1234)`` as make_fixture.py does."""
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.norm(self.fc1(x))))

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.mid = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mid(self.emb(x))))

    class Net(torch.nn.Module):  # data/z3_groups_frozen_bn_ws2: buffers, a frozen layer, two groups
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16, bias=False)
            self.bn = torch.nn.BatchNorm1d(16)
            self.frozen = torch.nn.Linear(16, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.frozen(torch.relu(self.bn(self.fc1(x))))))

    class Rope(torch.nn.Module):  # data/rotary_z3_ws2: rotary position embedding as in a Llama's rotary_emb
        def __init__(self, dim: int = 4, base: float = 10000.0) -> None:
            super().__init__()
            inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
            self.register_buffer("inv_freq", inv_freq, persistent=False)  # never saved: the module's own
            self.register_buffer("running_amp", torch.ones(1, device="cpu"))  # saved (rank-local statistic)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(h.shape[1], dtype=torch.float32, device=h.device)
            ang = pos[:, None] * self.inv_freq[None, :]
            cos, sin = ang.cos().to(h.dtype), ang.sin().to(h.dtype)
            a, b = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
            with torch.no_grad():
                self.running_amp.mul_(0.9).add_(0.1 * h.detach().float().abs().mean())
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.rope = Rope()
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.rope(self.fc1(x).view(x.shape[0], 4, 4))
            return self.fc2(torch.relu(h.reshape(x.shape[0], 16)))

    torch.manual_seed(1234)
    if kind == "rotary":
        return Rotary()
    if kind == "net":
        net = Net()
        net.frozen.requires_grad_(False)
        return net
    return Tied() if kind == "tied" else MLP()


def param_groups(model: Any, kind: str) -> Any:
    """The parameter groups the DeepSpeed run used: ``net`` has no-decay then decay groups (not in module
    order); the others pass ``model.parameters()``."""
    if kind != "net":
        return model.parameters()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if n.endswith("weight") and "bn" not in n]
    nodecay = [p for n, p in named if not (n.endswith("weight") and "bn" not in n)]
    return [{"params": nodecay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.05}]


def batch(kind: str, step: int, rank: int) -> tuple[Any, Any]:
    """The fixture's data rule: step ``step`` (1-based) of saved rank ``rank``."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "tied":
        return torch.randint(0, 10, (MICRO,), generator=g), torch.randint(0, 10, (MICRO,), generator=g)
    return torch.randn(MICRO, 8, generator=g), torch.randint(0, 4, (MICRO,), generator=g)


def layout(saved_ws: int, ws: int) -> tuple[int, int]:
    """``(micro batch, gradient accumulation)`` keeping the saved global batch of ``4 * saved_ws``."""
    per_rank = MICRO * saved_ws // ws
    micro = min(MICRO, per_rank)
    return micro, per_rank // micro


def my_micro_batches(kind: str, step: int, saved_ws: int, rank: int, ws: int) -> list[tuple[Any, Any]]:
    """This rank's micro-batches of a global step: the saved ranks' batches concatenated, then split
    evenly over the new ranks and into micro-batches."""
    import torch

    xs, ys = zip(*(batch(kind, step, r) for r in range(saved_ws)))
    x, y = torch.cat(xs), torch.cat(ys)
    per_rank = MICRO * saved_ws // ws
    micro, gas = layout(saved_ws, ws)
    lo = rank * per_rank
    return [(x[lo + i * micro : lo + (i + 1) * micro], y[lo + i * micro : lo + (i + 1) * micro]) for i in range(gas)]


def engine_for(exp: dict[str, Any], stage: int, ws: int) -> Any:
    """A dscore engine with the fixture's config at ZeRO ``stage`` on ``ws`` ranks (same global batch)."""
    import dscore

    cfg = json.loads(json.dumps(exp["config"]))
    micro, gas = layout(int(exp["world_size"]), ws)
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = gas
    cfg.pop("train_batch_size", None)
    cfg["zero_optimization"] = {"stage": stage}
    kind = exp.get("model", "mlp")
    model = make_model(kind)
    engine, *_ = dscore.initialize(model=model, model_parameters=param_groups(model, kind), config=cfg)
    return engine


def train_steps(engine: Any, exp: dict[str, Any], steps: list[int]) -> None:
    """Run the given global steps with the fixture's data rule on this rank."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    kind = exp.get("model", "mlp")
    cast = torch.bfloat16 if exp["dtype"] == "bf16" and kind != "tied" else None
    for step in steps:
        for x, y in my_micro_batches(kind, step, int(exp["world_size"]), rank, ws):
            if cast is not None:
                x = x.to(cast)
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()


def max_errors(
    got: dict[str, Any], want: dict[str, list[float]], *, rank_local_buffers: bool = False
) -> dict[str, float]:
    """Largest absolute difference per parameter between a state dict and expected flat lists.

    With ``rank_local_buffers`` running statistics (BatchNorm's, the rotary fixture's ``rope.running_amp``)
    are skipped: DeepSpeed's are rank 0's own,
    which another world size does not reproduce (the micro-batches seen per rank differ)."""
    import torch

    out = {}
    for name, values in want.items():
        if rank_local_buffers and (".running_" in name or name.endswith("num_batches_tracked")):
            continue
        t = got[name].detach().float().reshape(-1).cpu()
        ref = torch.tensor(values, dtype=torch.float32)
        out[name] = float((t - ref).abs().max()) if t.numel() == ref.numel() else float("inf")
    return out


def imported_worker(jobs: list[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """:func:`resume_worker` for ``(fixture path, directory to load, stage)`` jobs (imported copies)."""
    return resume_worker(jobs)


def resume_worker(jobs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """On every rank: for each ``(fixture path, stage)`` (or ``(fixture path, load dir, stage)``) load the
    checkpoint into a fresh engine, record what was restored, train steps 4 and 5, and compare with
    ``at_end`` (rank 0 reports)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    results = []
    for job in jobs:
        path, load_dir, stage = (job[0], job[0], job[1]) if len(job) == 2 else job
        exp = expected(path)
        engine = engine_for(exp, stage, ws)
        load_path, client = engine.load_checkpoint(load_dir)
        restored = {
            "load_path": os.path.basename(load_path or ""),
            "client": client,
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "lr_after_load": engine.get_lr(),
        }
        train_steps(engine, exp, [exp["save_at"] + 1 + i for i in range(exp["total_steps"] - exp["save_at"])])
        final = engine.zero_stage_impl.module_state_dict()  # collective under ZeRO-3
        if rank == 0:
            results.append(
                {
                    "fixture": os.path.basename(path),
                    "stage": stage,
                    "ws": ws,
                    "dtype": exp["dtype"],
                    "restored": restored,
                    "errors": max_errors(
                        final, exp["at_end"]["params"], rank_local_buffers=ws != int(exp["world_size"])
                    ),
                    "lr_end": engine.get_lr(),
                    "global_steps_end": engine.global_steps,
                }
            )
        engine.destroy()
    return results


def _weights(engine: Any) -> dict[str, Any]:
    return {k: v.detach().float().clone() for k, v in engine.zero_stage_impl.module_state_dict().items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _opt_entries(engine: Any) -> int:
    opt = engine.optimizer
    return sum(1 for s in opt.state.values() if s) if opt is not None else 0


def options_worker(good: str, broken: str, no_latest: str, poisoned: str) -> dict[str, Any]:
    """The load options and refusals on a 2-rank engine (rank 0 reports)."""
    import torch

    import dscore
    from dscore.errors import CheckpointError

    exp = expected(str(FIXTURES / "z2_fp32_ws2"))
    out: dict[str, Any] = {}

    # a missing shard: refused before anything is applied
    engine = engine_for(exp, 3, 2)
    before = _weights(engine)
    try:
        engine.load_checkpoint(broken)
        out["missing_shard"] = {"error": "", "unchanged": False}
    except CheckpointError as exc:
        out["missing_shard"] = {
            "error": str(exc),
            "unchanged": _same(before, _weights(engine)) and engine.global_steps == 0,
        }

    # a poisoned shard: refused (type and file named), engine untouched
    before = _weights(engine)
    try:
        engine.load_checkpoint(poisoned)
        out["poisoned"] = {"error": "", "unchanged": False}
    except CheckpointError as exc:
        out["poisoned"] = {"error": str(exc), "unchanged": _same(before, _weights(engine)) and engine.global_steps == 0}

    # load_universal without latest_universal: a clear error, not (None, None)
    cfg = json.loads(json.dumps(exp["config"]))
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = layout(2, 2)
    cfg["checkpoint"] = {"load_universal": True}
    eng_u, *_ = dscore.initialize(model=make_model("mlp"), config=cfg)
    try:
        eng_u.load_checkpoint(good)
        out["universal_error"] = ""
    except CheckpointError as exc:
        out["universal_error"] = str(exc)

    # no `latest` and no tag: nothing to resume from (DeepSpeed's rule)
    out["no_latest"] = list(engine.load_checkpoint(no_latest))

    # load_module_strict: a model with another layer is refused and left alone
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    eng_s, *_ = dscore.initialize(model=other, config=cfg | {"checkpoint": {}})
    before = _weights(eng_s)
    try:
        eng_s.load_checkpoint(good)
        out["strict_error"] = ""
    except CheckpointError as exc:
        out["strict_error"] = str(exc)
    out["strict_unchanged"] = _same(before, _weights(eng_s))

    want = {k: torch.tensor(v) for k, v in exp["at_save"]["params"].items()}

    def werr(e: Any) -> float:
        w = _weights(e)
        return max(float((w[k].reshape(-1) - want[k]).abs().max()) for k in want)

    for key, kwargs in (
        ("module_only", {"load_module_only": True}),
        ("no_optimizer_states", {"load_optimizer_states": False}),
        ("no_scheduler", {"load_lr_scheduler_states": False}),
        ("full", {"tag": "global_step3"}),
    ):
        e = engine_for(exp, 1, 2)
        _, client = e.load_checkpoint(good, **kwargs)
        out[key] = {
            "weights_err": werr(e),
            "global_steps": e.global_steps,
            "optimizer_state_entries": _opt_entries(e),
            "client": client,
            "last_batch_iteration": e.lr_scheduler.last_batch_iteration,
        }
    return out
