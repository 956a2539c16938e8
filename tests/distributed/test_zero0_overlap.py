"""ZeRO stage 0 with ``overlap_comm``: bucket all-reduces launched from gradient hooks during backward
give exactly the gradients of the post-backward reduction, and match a single-process reference, on two
real gloo ranks (frozen layer, unused parameter, two groups, gradient accumulation, several buckets).
Also checks that ``wall_clock_breakdown`` records the reduction sub-phases."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_zero_stages import CLIP, GAS, LR, MICRO, WORLD, batches, make_model, param_groups, reference
from torch import nn

from dscore.testing import run_distributed


def _dense(kind: str) -> nn.Module:
    """``"net"``: the shared test model (its unused parameter is the last one registered, so the first
    bucket never fills during backward and everything launches after it); ``"mlp"``: every parameter
    gets a gradient, so buckets launch from the hooks while backward is still running."""
    if kind == "net":
        return make_model()
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))


def _reference(kind: str) -> dict[str, torch.Tensor]:
    if kind == "net":
        return reference()[0]
    model = _dense(kind)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    for window in batches():
        for x, y in window:
            (F.mse_loss(model(x), y) / GAS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def _results() -> list[list[list[dict[str, Any]]]]:
    return run_distributed(_all, WORLD, timeout=300)


def _run(kind: str, overlap: bool, prescale: bool, breakdown: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import dscore
    from dscore.runtime.timers import active_timers

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": breakdown,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 60, "overlap_comm": overlap},
    }
    if prescale:
        config.update(prescale_gradients=True, gradient_predivide_factor=2.0)
    model = _dense(kind)
    engine, *_ = dscore.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank = dist.get_rank()
    for window in batches():
        for x, y in window:
            loss = F.mse_loss(engine(x[rank * MICRO : (rank + 1) * MICRO]), y[rank * MICRO : (rank + 1) * MICRO])
            engine.backward(loss)
            engine.step()
    timers = active_timers()
    phases = sorted(timers.totals()) if (breakdown and timers is not None) else []
    if timers is not None:
        timers.deactivate()
    return {
        "params": {k: v.detach().numpy().copy() for k, v in engine.module.state_dict().items()},
        "hooks": len(engine.zero_stage_impl._hooks),
        "phases": phases,
    }


_CASES = ((False, False, False), (True, False, True), (False, True, False), (True, True, False))


def _all() -> list[list[dict[str, Any]]]:
    return [[_run(kind, o, p, b) for o, p, b in _CASES] for kind in ("net", "mlp")]


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["unused-param-model", "dense-mlp"])
def test_stage0_overlapped_reduction_equals_post_backward_and_reference(which: int, _results: Any) -> None:
    kind = ("net", "mlp")[which]
    results = [r[which] for r in _results]
    ref = _reference(kind)
    for rank_results in results:
        plain, overlapped, plain_pre, overlapped_pre = rank_results
        assert plain["hooks"] == 0 and overlapped["hooks"] > 0
        for name, want in ref.items():
            got = torch.from_numpy(overlapped["params"][name])
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), f"{name}: {(got - want).abs().max():.3g}"
            # same elementwise operations in the same order: bit-identical to the post-backward path
            assert torch.equal(got, torch.from_numpy(plain["params"][name])), name
            assert torch.equal(
                torch.from_numpy(overlapped_pre["params"][name]), torch.from_numpy(plain_pre["params"][name])
            ), name
            assert torch.allclose(torch.from_numpy(plain_pre["params"][name]), want, atol=2e-5, rtol=1e-4), name
        phases = ["backward", "backward.reduce_wait", "forward", "step", "step.optimizer"]
        if kind == "mlp":  # launched from the hooks during backward
            phases.append("backward.reduce_launch")
        for phase in phases:
            assert phase in overlapped["phases"], (phase, overlapped["phases"])
    # both ranks end with the same weights
    for name in ref:
        assert torch.equal(torch.from_numpy(results[0][1]["params"][name]), torch.from_numpy(results[1][1]["params"][name]))
