"""Issue 33 items 2 and 7, issue 29 item 8: pipeline data streams and PipelineModule's early refusals.

Item 2 (DeepSpeed #3131): a dataset drawing ``random.random()`` in ``__getitem__`` and a loader on every
stage paired the last stage's labels with other samples' inputs. Now only the first stage reads the data
and sends each micro-batch's labels to the last stage: one sample stream per replica.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from dscore.errors import ConfigError, DistributedError
from dscore.pipe import PipelineModule
from dscore.testing import run_distributed


class Scale(torch.nn.Module):
    """``x * w`` with ``w = 1`` at the start, so the untrained model is the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class RandomPairs(torch.utils.data.Dataset):
    """Sample ``i`` is ``(r, r)`` for a fresh ``r = random.random()``: inputs equal labels only when the
    stages read the same draw."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = random.random()
        return torch.tensor([r]), torch.tensor([r])


def _mse(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((out - labels) ** 2).mean()


def _train_random_dataset() -> list[float]:
    import torch.distributed as dist

    import dscore

    random.seed(1000 + dist.get_rank())  # every process draws its own numbers, as in the report
    pipe = PipelineModule(layers=[Scale(), Scale()], num_stages=2, loss_fn=_mse)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = dscore.initialize(model=pipe, config=config, training_data=RandomPairs())
    losses = [float(engine.train_batch()) for _ in range(3)]
    engine.close()
    return losses


def test_pipeline_stages_read_one_sample_stream() -> None:
    for losses in run_distributed(_train_random_dataset, 2, timeout=240):
        # the model starts as the identity and inputs equal labels: every loss is 0 (SGD keeps w = 1)
        assert losses == [0.0, 0.0, 0.0]


def test_fewer_layers_than_stages_is_refused_naming_the_counts() -> None:
    with pytest.raises(ConfigError, match=r"1 layer\(s\) for num_stages=2.*num_stages <= 1"):
        PipelineModule(layers=[Scale()], num_stages=2, loss_fn=_mse)


def test_pipeline_module_before_the_process_group_names_the_launched_world(monkeypatch: Any) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedError, match=r"WORLD_SIZE=2.*dscore.init_distributed\(\)"):
        PipelineModule(layers=[Scale(), Scale()], num_stages=2, loss_fn=_mse)
