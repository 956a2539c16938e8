"""The plain path depends on no moved unit (issue 37, item 3): with every unit disabled except the few a plain
job names (the cpu accelerator, gloo, fp32, the standard engine, the ZeRO stages and their section, and the
optimizer spec that knows torch's AdamW), a 2-rank job trains at ZeRO 0-3 with a torch optimizer and gives the
losses of the same job with every unit on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscore.testing import run_distributed

#: what a plain job (cpu, gloo, torch AdamW, ZeRO 0-3, fp32) selects by name: the only units left on
PLAIN = {
    "accelerator:cpu",
    "comm_backend:gloo",
    "precision:fp32",
    "engine:standard",
    "zero_stage:stage0",
    "zero_stage:stage1",
    "zero_stage:stage2",
    "zero_stage:stage3",
    "config_section:zero_optimization",
    "optimizer:adamw",
}


def _every_other_unit() -> list[str]:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import SPEC_KINDS

    registry = Registry(create_plugin_manager(environ={}))
    units = [f"{kind}:{name}".lower() for kind in SPEC_KINDS for name in registry.names(kind)]
    return sorted(set(units) - PLAIN)


def _train_every_stage(disable: list[str]) -> dict[str, Any]:
    import dscore

    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        config = {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
            "gradient_clipping": 1.0,
            "plugins": {"disable": disable},
        }
        engine, _, _, _ = dscore.initialize(model=model, model_parameters=model.parameters(), config=config)
        rank = engine.global_rank
        gen = torch.Generator().manual_seed(10 + rank)
        losses = []
        for _ in range(3):
            x = torch.randn(2, 6, generator=gen)
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out[f"stage{stage}"] = losses
        out[f"stage{stage}_disabled"] = sorted(engine.runtime.registry.manager.disabled_units)
        engine.close()
    return out


@pytest.mark.slow
def test_the_plain_path_trains_with_every_other_unit_disabled() -> None:
    others = _every_other_unit()
    assert {"comm_transport:shm", "launcher:slurm", "model_transform:autotp", "checkpoint_layout:deepspeed",
            "zero_feature:hpz", "op_builder:cpu_adam"} <= set(others)
    reference = run_distributed(_train_every_stage, 2, [], timeout=300)
    bare = run_distributed(_train_every_stage, 2, others, timeout=300)
    for rank in range(2):
        for stage in range(4):
            assert bare[rank][f"stage{stage}_disabled"] == others
            torch.testing.assert_close(bare[rank][f"stage{stage}"], reference[rank][f"stage{stage}"], rtol=0, atol=0)
