"""fp16 overflow at ``min_loss_scale``: the same behaviour at every ZeRO stage (issue 15 item 6).

Before the fix stage 0 kept skipping steps at scale 1 silently (info logs only) while stage 2 raised.
Now the loss scaler decides for every stage: the overflow that would have to lower a scale that already is
the minimum raises :class:`LossScaleUnderflowError` (DeepSpeed's loss-scaler rule).
"""

from __future__ import annotations

import pytest
import torch

import dscore
from dscore_plugins.precision.loss_scaler import LossScaleUnderflowError


def _run_until_error(stage: int, hysteresis: int) -> tuple[list[float], list[bool], int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 1, "hysteresis": hysteresis},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    scales: list[float] = []
    applied: list[bool] = []
    x = torch.randn(2, 4).half()
    for calls in range(1, 20):
        loss = engine(x).float().pow(2).mean() * float("inf")
        engine.backward(loss)
        try:
            engine.step()
        except LossScaleUnderflowError as exc:
            assert "min_loss_scale=1" in str(exc)
            return scales, applied, calls
        scales.append(engine.get_loss_scale())
        applied.append(engine.was_step_applied())
    pytest.fail(f"ZeRO stage {stage}: no LossScaleUnderflowError after 19 overflowing steps at scale {scales[-1]}")


@pytest.mark.parametrize("stage", [0, 2])
def test_overflow_at_min_scale_raises_at_every_stage(stage: int) -> None:
    scales, applied, calls = _run_until_error(stage, hysteresis=1)
    # 4 -> 2 -> 1, then the overflow at 1 raises: identical at stage 0 and 2
    assert scales == [2.0, 1.0]
    assert applied == [False, False]
    assert calls == 3


def test_stage0_and_stage2_agree_on_when_the_run_stops() -> None:
    # hysteresis only delays the stage 1-3 scaler (DeepSpeed's ZeRO rule); both stages still end with the error
    s0 = _run_until_error(0, hysteresis=2)
    s2 = _run_until_error(2, hysteresis=2)
    assert s0[0][-1] == s2[0][-1] == 1.0
    assert s0[2] == 3 and s2[2] == 4
