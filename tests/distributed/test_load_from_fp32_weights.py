"""``zero_optimization.load_from_fp32_weights`` (issue 29 item 3) at stages 1-3 with bf16.

Loading a checkpoint restores the fp32 master weights from the checkpoint's fp32 copy (true, the default)
or rebuilds them from the loaded bf16 module weights (false), as DeepSpeed's ZeRO optimizers do. After a
few bf16 steps the two differ (the masters hold bits bf16 rounds away), so each case is observable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dscore.testing import run_distributed


def _config(stage: int, fp32_weights: bool | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if fp32_weights is not None:
        zero["load_from_fp32_weights"] = fp32_weights
    return {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero,
    }


def _masters(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in engine.zero_stage_impl.state_dict()["fp32_params"].items()}


def _run(save_dir: str) -> dict[str, Any]:
    import dscore

    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        engine, *_ = dscore.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, None))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 6, generator=g).to(torch.bfloat16)
            engine.backward(F.mse_loss(engine(x).float(), torch.randn(4, 2, generator=g)))
            engine.step()
        saved = _masters(engine)
        weights = {k: v.float() for k, v in engine.zero_stage_impl.module_state_dict().items()}
        engine.save_checkpoint(f"{save_dir}/s{stage}", tag="t")
        for fp32_weights in (None, False):
            torch.manual_seed(5)  # other initial weights: everything must come from the checkpoint
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
            cfg = _config(stage, fp32_weights)
            loaded_engine, *_ = dscore.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            loaded_engine.load_checkpoint(f"{save_dir}/s{stage}", tag="t")
            got = _masters(loaded_engine)
            out[(stage, fp32_weights)] = {
                "equals_saved_masters": all(torch.equal(got[k], saved[k]) for k in saved),
                "equals_bf16_weights": all(torch.equal(got[k], weights[k]) for k in saved),
                "masters_differ_from_weights": any(not torch.equal(saved[k], weights[k]) for k in saved),
            }
    return out


@pytest.mark.slow
def test_load_from_fp32_weights(tmp_path: Any) -> None:
    (res,) = run_distributed(_run, 1, str(tmp_path), timeout=300)
    for stage in (1, 2, 3):
        default, from_16bit = res[(stage, None)], res[(stage, False)]
        assert default["masters_differ_from_weights"], stage  # the two cases can be told apart
        assert default["equals_saved_masters"] and not default["equals_bf16_weights"], (stage, default)
        assert from_16bit["equals_bf16_weights"] and not from_16bit["equals_saved_masters"], (stage, from_16bit)
