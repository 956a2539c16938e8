"""Gradient reduction keys at every ZeRO stage (issue 29 item 4), on two gloo ranks.

* ``gradient_allreduce_op: "sum"`` sums gradients across ranks at stages 0-2 (DeepSpeed refuses it at 3);
* ``prescale_gradients`` divides by the world size before the sum and ``gradient_predivide_factor`` f by f
  before and world/f after (DeepSpeed's ``allreduce_bucket``): the result is the mean, and the values
  that go into the collective are the local gradients divided by world (prescale) or f;
* ``communication_data_type: "fp32"`` with bf16 reduces in fp32: every gradient collective carries fp32,
  and at stages 1-3 (fp32 gradient partitions) the result is the fp32 sum of the ranks' bf16 gradients.

References are plain PyTorch in one process. All scenarios share one spawn of the ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dscore.testing import run_distributed

WORLD = 2
MICRO = 3
LR = 0.05
STEPS = 2


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).to(dtype)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(WORLD * MICRO, 5, generator=g), torch.randn(WORLD * MICRO, 2, generator=g)) for _ in range(STEPS)]


def local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each rank's gradients (its rows of the batch), in the model's dtype."""
    out = []
    for r in range(WORLD):
        model.zero_grad()
        rows = slice(r * MICRO, (r + 1) * MICRO)
        F.mse_loss(model(x[rows].to(next(model.parameters()).dtype)).float(), y[rows]).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    return out


def reference(op: str, bf16: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """SGD on the sum (``op="sum"``) or mean of the ranks' gradients; ``bf16``: bf16 model, gradients
    summed in fp32 into fp32 master weights. Also returns each step's per-rank sum of |local gradient|."""
    model = make_model(torch.bfloat16 if bf16 else torch.float32)
    masters = [p.detach().float().clone() for p in model.parameters()]
    local_abs = []
    for x, y in data():
        grads = local_grads(model, x, y)
        local_abs.append([sum(float(g.float().abs().sum()) for g in gs) for gs in grads])
        with torch.no_grad():
            for k, (m, p) in enumerate(zip(masters, model.parameters())):
                total = sum(gs[k].float() for gs in grads)
                m.add_(total if op == "sum" else total / WORLD, alpha=-LR)
                p.copy_(m)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, local_abs


def _train(stage: int, keys: dict[str, Any], bf16: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import dscore
    from dscore.comm.facade import Comm

    seen: list[tuple[str, float]] = []
    originals = {name: getattr(Comm, name) for name in ("all_reduce", "reduce_scatter_tensor")}

    def recording(name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = args[1] if name == "reduce_scatter_tensor" else args[0]
            if t.numel() > 4:  # a gradient bucket, not a norm or a fingerprint
                seen.append((str(t.dtype), float(t.float().abs().sum())))
            return originals[name](self, *args, **kwargs)

        return call

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 20},
        **keys,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    model = make_model()
    engine, *_ = dscore.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    steps = []
    try:
        for name in originals:
            setattr(Comm, name, recording(name))
        for x, y in data():
            seen.clear()
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            xs = x[rows].to(torch.bfloat16 if bf16 else torch.float32)
            engine.backward(F.mse_loss(engine(xs).float(), y[rows]))
            steps.append(list(seen))
            engine.step()
    finally:
        for name, fn in originals.items():
            setattr(Comm, name, fn)
    state = engine.zero_stage_impl.module_state_dict()
    return {"params": {k: v.detach().float().numpy().copy() for k, v in state.items()}, "collectives": steps}


SCENARIOS: list[tuple[int, dict[str, Any], bool]] = [
    *[(s, {"gradient_allreduce_op": "sum"}, False) for s in (0, 1, 2)],
    *[(s, {"prescale_gradients": True}, False) for s in (0, 1, 2, 3)],
    *[(s, {"gradient_predivide_factor": 4.0}, False) for s in (0, 1, 2, 3)],
    *[(s, {"communication_data_type": "fp32"}, True) for s in (0, 1, 2, 3)],
    (2, {}, True),  # bf16 reduced in bf16: shows the fp32 reference can tell the difference
]


def _all() -> list[dict[str, Any]]:
    return [_train(*s) for s in SCENARIOS]


@pytest.mark.slow
def test_reduction_keys_at_every_stage() -> None:
    results = run_distributed(_all, WORLD, timeout=400)
    for rank, per_rank in enumerate(results):
        for (stage, keys, bf16), res in zip(SCENARIOS, per_rank):
            what = (rank, stage, keys, bf16)
            op = keys.get("gradient_allreduce_op", "mean")
            ref, local_abs = reference(op, bf16)
            exact_fp32_sum = bf16 and keys.get("communication_data_type") == "fp32" and stage > 0
            for k, v in ref.items():
                got = torch.from_numpy(res["params"][k])
                if not bf16:
                    assert torch.allclose(got, v, atol=1e-6, rtol=1e-5), (what, k, (got - v).abs().max())
                elif exact_fp32_sum:
                    assert torch.equal(got, v), (what, k, (got - v).abs().max())
            if bf16 and not keys:
                assert any(not torch.equal(torch.from_numpy(res["params"][k]), v) for k, v in ref.items()), what
            grads = [c for c in res["collectives"][0]]
            assert grads, what
            if "communication_data_type" in keys:
                assert {d for d, _ in grads} == {"torch.float32"}, (what, grads)
            if "prescale_gradients" in keys or "gradient_predivide_factor" in keys:
                # the collective's input is this rank's gradient divided by world (prescale) or f
                div = WORLD if "prescale_gradients" in keys else 4.0
                sent = sum(a for _, a in grads)
                assert sent == pytest.approx(local_abs[0][rank] / div, rel=1e-4), (what, sent, local_abs[0][rank])


def test_sum_refused_at_stage3() -> None:
    from dscore.config.load import load_config
    from dscore.errors import ConfigError

    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        load_config(
            {"train_batch_size": 2, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, world_size=1
        )
