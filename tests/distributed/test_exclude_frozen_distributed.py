"""``exclude_frozen_parameters=True`` on 2 gloo ranks under ZeRO stages 2 and 3 (issue 15 item 7).

Every rank saves (ZeRO-3 gathers the partitioned weights), the frozen base is left out, and a fresh engine
whose frozen base is already set restores the trainable weights and optimizer partitions: its next steps
equal the saved run's.
"""

from __future__ import annotations

import os

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def _model(seed: int):
    import torch

    class Lora(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.base = torch.nn.Linear(6, 6)
            self.base.requires_grad_(False)
            torch.manual_seed(seed)
            self.down = torch.nn.Linear(6, 3, bias=False)
            self.up = torch.nn.Linear(3, 6)

        def forward(self, x):
            return self.base(x) + self.up(self.down(x))

    return Lora()


def _engine(stage: int, seed: int):
    import dscore

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = dscore.initialize(model=_model(seed), config=config)
    return engine


def _train(engine, steps: int, seed: int) -> None:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 6, generator=g)).pow(2).mean())
        engine.step()


def _full(engine) -> dict:
    return {k: v.detach().clone().tolist() for k, v in engine.zero_stage_impl.module_state_dict().items()}


def _case(save_root: str) -> dict:
    import torch.distributed as dist

    from dscore.persistence.savedir import MODEL_FILE
    from dscore.persistence.tensorfile import read_tensor_file

    out = {}
    for stage in (2, 3):
        save_dir = os.path.join(save_root, f"stage{stage}")
        saved = _engine(stage, seed=1)
        _train(saved, 3, seed=10)
        saved.save_checkpoint(save_dir, tag="t", exclude_frozen_parameters=True)
        dist.barrier()
        keys = sorted(read_tensor_file(os.path.join(save_dir, "t", MODEL_FILE))[0])
        fresh = _engine(stage, seed=2)
        fresh.load_checkpoint(save_dir, tag="t")
        after_load = (_full(fresh), _full(saved))
        _train(saved, 2, seed=20)
        _train(fresh, 2, seed=20)
        out[stage] = {"keys": keys, "after_load": after_load, "after_steps": (_full(fresh), _full(saved)),
                      "steps": fresh.global_steps}
    return out


def test_exclude_frozen_two_ranks_zero2_and_zero3(tmp_path) -> None:
    import torch

    results = run_distributed(_case, 2, str(tmp_path), timeout=400)
    for rank, res in enumerate(results):
        for stage, r in res.items():
            assert r["keys"] == ["down.weight", "up.bias", "up.weight"], (rank, stage)
            assert r["steps"] == 5
            for label in ("after_load", "after_steps"):
                have, want = r[label]
                assert set(have) == set(want)
                for k in want:
                    torch.testing.assert_close(torch.tensor(have[k]), torch.tensor(want[k]), rtol=1e-6, atol=1e-7,
                                               msg=f"rank {rank} stage {stage} {label} {k}")
