"""``save_checkpoint(..., exclude_frozen_parameters=True)`` (issue 15 item 7; used by LoRA runs).

It raised ``TypeError: unexpected keyword argument``. DeepSpeed's meaning: frozen weights are left out of
the saved module state; a load into a model whose frozen weights are already set restores the rest (missing
keys allowed for exactly those parameters).
"""

from __future__ import annotations

import os

import pytest
import torch

import dscore
from dscore.errors import CheckpointError
from dscore.persistence.savedir import MODEL_FILE
from dscore.persistence.tensorfile import read_tensor_file


class Lora(torch.nn.Module):
    def __init__(self, seed: int, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the frozen base is the same "pretrained" weight in every instance
        self.base = torch.nn.Linear(6, 6)
        self.base.requires_grad_(False)
        torch.manual_seed(seed)
        self.down = torch.nn.Linear(6, 2, bias=False)
        self.up = torch.nn.Linear(2, 6, bias=False)
        self.extra = torch.nn.Linear(6, 6) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _engine(model: torch.nn.Module):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    return engine


def _train(engine, steps: int, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 6, generator=g)).pow(2).mean())
        engine.step()


def test_frozen_weights_are_left_out_and_the_rest_restores(tmp_path) -> None:
    saved = _engine(Lora(seed=1))
    _train(saved, 3)
    assert saved.save_checkpoint(str(tmp_path), tag="t", exclude_frozen_parameters=True) is True
    keys = set(read_tensor_file(os.path.join(tmp_path, "t", MODEL_FILE))[0])
    assert keys == {"down.weight", "up.weight"}

    fresh = _engine(Lora(seed=2))  # trainable weights differ, frozen base already set
    path, _ = fresh.load_checkpoint(str(tmp_path), tag="t")  # strict by default
    assert path is not None
    for (n, a), b in zip(fresh.module.named_parameters(), saved.module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert fresh.global_steps == 3
    # moments came back too: the next steps match the saved run's next steps
    _train(saved, 2, seed=9)
    _train(fresh, 2, seed=9)
    for a, b in zip(fresh.module.parameters(), saved.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_default_still_saves_frozen_weights(tmp_path) -> None:
    engine = _engine(Lora(seed=1))
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path), tag="t")
    keys = set(read_tensor_file(os.path.join(tmp_path, "t", MODEL_FILE))[0])
    assert {"base.weight", "base.bias"} <= keys


def test_strict_load_still_refuses_other_missing_keys(tmp_path) -> None:
    saved = _engine(Lora(seed=1))
    _train(saved, 1)
    saved.save_checkpoint(str(tmp_path), tag="t", exclude_frozen_parameters=True)
    other = _engine(Lora(seed=2, extra=True))  # a trainable layer the checkpoint never had
    with pytest.raises(CheckpointError, match=r"extra\.weight"):
        other.load_checkpoint(str(tmp_path), tag="t")
    relaxed = _engine(Lora(seed=2, extra=True))
    relaxed.load_checkpoint(str(tmp_path), tag="t", load_module_strict=False, load_optimizer_states=False)
    torch.testing.assert_close(relaxed.module.up.weight, saved.module.up.weight)
