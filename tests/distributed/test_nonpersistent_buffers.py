"""Non-persistent buffers (``register_buffer(..., persistent=False)``, e.g. a Hugging Face Llama's
``rotary_emb.inv_freq``) are in no state dict: every ZeRO stage saves without them and loads keeping the
module's own values, in the native and the DeepSpeed checkpoint layout (2 gloo ranks)."""

from __future__ import annotations

import os

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def _module():
    import torch

    class WithTables(torch.nn.Module):
        """A persistent buffer (saved) and a non-persistent one (recomputed by the module, never saved)."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 16)
            self.fc2 = torch.nn.Linear(16, 3)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 16, device="cpu"))
            self.register_buffer("inv_freq", torch.arange(16, dtype=torch.float32, device="cpu") / 16.0,
                                 persistent=False)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x) * self.scale + self.inv_freq))

    torch.manual_seed(0)
    return WithTables()


def _engine(stage: int, layout: str):
    import dscore

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = dscore.initialize(model=_module(), config=config)
    engine.checkpoint_layout = layout
    return engine


def _train(engine, steps: int, seed: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(seed + engine.global_rank)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 6, generator=g, device="cpu")).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _roundtrip(root: str) -> dict:
    """Per stage and layout: save after 2 steps, load into a fresh engine, train 2 more steps in both."""
    import torch

    out: dict = {}
    for stage in (0, 1, 2, 3):
        for layout in ("dscore", "deepspeed") if stage else ("dscore",):  # DeepSpeed's layout: ZeRO 1-3
            where = os.path.join(root, f"{layout}{stage}")
            first = _engine(stage, layout)
            _train(first, 2, seed=1)
            first.save_checkpoint(where)
            saved_keys = sorted(first.module_state_dict())
            fresh = _engine(stage, layout)
            fresh.module.inv_freq.mul_(2.0)  # the fresh module's own value must survive the load
            fresh.load_checkpoint(where)
            kept = bool(torch.equal(fresh.module.inv_freq, torch.arange(16, dtype=torch.float32) / 8.0))
            fresh.module.inv_freq.div_(2.0)
            # load_module_only goes through the same weights-only path
            only = _engine(stage, layout)
            only.load_checkpoint(where, load_module_only=True, load_optimizer_states=False,
                                 load_lr_scheduler_states=False)
            refused = []  # strict loads name missing and unknown keys, as torch's load_state_dict
            sd = first.module_state_dict()
            for bad in ({**sd, "bogus": sd["scale"]}, {k: v for k, v in sd.items() if k != "scale"}):
                try:
                    first.zero_stage_impl.load_module_state_dict(bad, strict=True)
                except (KeyError, RuntimeError) as exc:
                    refused.append("bogus" in str(exc) or "scale" in str(exc))
            after_first, after_fresh = _train(first, 2, seed=2), _train(fresh, 2, seed=2)
            out[(stage, layout)] = {
                "saved_keys": saved_keys,
                "kept": kept,
                "same": after_first == after_fresh,
                "only_same": sorted(only.module_state_dict()) == saved_keys,
                "refused": refused,
            }
            for e in (first, fresh, only):
                e.close()
    return out


def test_nonpersistent_buffer_roundtrips_at_every_stage_and_layout(tmp_path) -> None:
    results = run_distributed(_roundtrip, 2, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        for (stage, layout), r in res.items():
            where = f"rank {rank} stage {stage} layout {layout}"
            assert r["saved_keys"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "scale"], where
            assert r["kept"] and r["same"] and r["only_same"], where
            assert r["refused"] == [True, True], where
