"""Parameters are current as soon as ``engine.step()`` returns, at every ZeRO stage (2 gloo ranks).

DeepSpeed's stages 0-2 hand back updated full parameters from ``step()``: user code that reads
``engine.module.state_dict()`` or the parameter tensors right after a step (logging, EMA, a manual
checkpoint) before the next forward sees this step's values. With ``overlap_comm`` the stage-1/2
all-gather of updated partitions must therefore be finished by the time ``step()`` returns, not left to
the next forward's pre-hooks. Stage 3 keeps parameters partitioned by design; there
``engine.module_state_dict()`` and ``dscore.zero.GatheredParameters`` must give the current values.

Each scenario trains the tiny model of ``test_zero_stages`` through ``dscore.initialize`` (gradient
accumulation 2, clipping, AdamW with two groups, a frozen layer, an unused parameter, buckets smaller
than the model) and compares the values read after every optimizer step with a single-process
PyTorch reference after the same number of steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_zero_stages import MICRO, STEPS, WORLD, batches, engine_config, make_model, param_groups, reference

from dscore.testing import run_distributed

# (label, stage, extra zero_optimization keys); every one runs with overlap_comm true
SCENARIOS: list[tuple[str, int, dict[str, Any]]] = [
    ("stage0", 0, {}),
    ("stage1", 1, {}),
    ("stage1-no-contiguous", 1, {"contiguous_gradients": False}),
    ("stage2", 2, {}),
    ("stage2-allgather-pieces", 2, {"allgather_bucket_size": 8}),
    ("stage2-broadcast", 2, {"allgather_partitions": False}),
    ("stage2-offload", 2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    ("stage3", 3, {}),
]


def _numpy(t: torch.Tensor) -> Any:
    # numpy, not tensors: torch shares tensors between processes through handles that die with the rank
    return t.detach().float().clone().numpy()


def _run(stage: int, extra: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import dscore

    config = engine_config(stage, overlap_comm=True, **extra)
    model = make_model()
    engine, *_ = dscore.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank = dist.get_rank()
    seen: list[dict[str, Any]] = []
    for window in batches():
        for x, y in window:
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
        # read right after the boundary step, before any further forward
        if stage == 3:
            full = {k: _numpy(v) for k, v in engine.module_state_dict().items()}
            names = [n for n, _ in engine.module.named_parameters()]
            with dscore.zero.GatheredParameters(list(engine.module.parameters())):
                gathered = {n: _numpy(p) for n, p in zip(names, engine.module.parameters())}
            seen.append({"state_dict": full, "params": gathered})
        else:
            seen.append({
                "state_dict": {k: _numpy(v) for k, v in engine.module.state_dict().items()},
                "params": {n: _numpy(p) for n, p in engine.module.named_parameters()},
            })
    engine.close()
    return seen


def _all() -> dict[str, list[dict[str, Any]]]:
    return {label: _run(stage, extra) for label, stage, extra in SCENARIOS}


@pytest.mark.slow
def test_parameters_are_current_right_after_step_with_overlap_comm() -> None:
    results = run_distributed(_all, WORLD, timeout=600)
    refs = [reference(k + 1)[0] for k in range(STEPS)]
    stale: list[str] = []
    for rank, per_rank in enumerate(results):
        for label, _, _ in SCENARIOS:
            steps = per_rank[label]
            assert len(steps) == STEPS
            for k, (seen, ref) in enumerate(zip(steps, refs)):
                for what in ("state_dict", "params"):
                    got = seen[what]
                    expected = ref.keys() if what == "state_dict" else got.keys()
                    assert set(got) == set(expected), (label, what)
                    for name in expected:
                        g = torch.from_numpy(got[name])
                        r = ref[name]
                        assert g.shape == r.shape, (label, what, name)
                        if not torch.allclose(g, r, atol=2e-5, rtol=1e-4):
                            stale.append(f"rank {rank} {label}: {what}[{name}] after step {k + 1} off by "
                                         f"{(g - r).abs().max():.3g}")
    labels = sorted({line.split(" ")[2].rstrip(":") for line in stale})
    assert not stale, f"{len(stale)} stale reads right after step() in {labels}, e.g.:\n" + "\n".join(stale[:12])
