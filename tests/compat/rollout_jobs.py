"""Rank functions for tests/compat/test_compat_hybrid_rollout.py (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any


def hybrid_isinstance() -> list[Any]:
    """isinstance(engine, DeepSpeedHybridEngine) for a hybrid and a plain config; generate through deepspeed."""
    import sys
    from pathlib import Path

    import deepspeed
    import torch
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    import hybrid_runs

    out = []
    for enabled in (True, False):
        cfg = hybrid_runs.config({"stage": 3, "stage3_param_persistence_threshold": 0})
        cfg["hybrid_engine"]["enabled"] = enabled
        engine, *_ = deepspeed.initialize(model=hybrid_runs.tiny_model("qwen2"), config=cfg)
        out.append(isinstance(engine, DeepSpeedHybridEngine))
        if enabled:
            engine.eval()
            ids = torch.tensor([[3, 4, 7]])
            out.append(engine.generate(ids, max_new_tokens=3, do_sample=False).shape[1])
        engine.close()
    return out
