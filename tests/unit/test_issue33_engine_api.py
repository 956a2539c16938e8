"""Issue 33 items 5, 9 and 12: the scheduler after a load, two config sources, left-out engine APIs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dscore
from dscore.runtime.engine import LEFT_OUT_APIS, EngineAPIMissing
from dscore.runtime.initialize import InitializeError

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "total_num_steps": 20},
    },
}


def _engine():
    torch.manual_seed(0)
    engine, *_ = dscore.initialize(model=torch.nn.Linear(3, 1), config=CONFIG)
    return engine


def _train(engine, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 3, generator=g)).pow(2).mean())
        engine.step()


@pytest.mark.parametrize("load_optimizer_states", [True, False])
def test_scheduler_get_last_lr_after_load_is_the_resumed_lr(tmp_path: Path, load_optimizer_states: bool) -> None:
    run = _engine()
    _train(run, 3)
    run.save_checkpoint(str(tmp_path), tag="t")
    want = run.get_lr()
    assert want[0] > 0.0
    run.close()

    resumed = _engine()
    assert resumed.lr_scheduler.get_last_lr() == [0.0]
    resumed.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=load_optimizer_states)
    assert resumed.lr_scheduler.get_last_lr() == pytest.approx(want)
    assert resumed.get_lr() == pytest.approx(want)
    resumed.close()


def test_config_and_config_params_together_are_refused() -> None:
    other = {**CONFIG, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(InitializeError, match="config= and as config_params="):
        dscore.initialize(model=torch.nn.Linear(3, 1), config=CONFIG, config_params=other)
    engine, *_ = dscore.initialize(model=torch.nn.Linear(3, 1), config_params=other)
    assert engine.train_micro_batch_size_per_gpu() == 4
    engine.close()


def test_left_out_deepspeed_apis_name_themselves_and_the_docs() -> None:
    engine = _engine()  # one engine for every name: building one per name costs ~1 s each
    for name in sorted(LEFT_OUT_APIS):
        assert not hasattr(engine, name), name
        with pytest.raises(EngineAPIMissing, match=rf"engine\.{name} .*docs/engine-api\.md"):
            getattr(engine, name)
    with pytest.raises(AttributeError, match="no attribute 'not_an_api'"):
        engine.not_an_api  # noqa: B018
    engine.close()


def test_every_left_out_api_is_in_the_docs_table(repo_root: Path) -> None:
    text = (repo_root / "docs" / "engine-api.md").read_text()
    table = text.split("## Left out, with the reason", 1)[1]
    prefixes = ("flops", "autotuning", "curriculum", "data_efficiency", "random_ltd", "eigenvalue", "pld",
                "quantize", "sparse")
    for name in LEFT_OUT_APIS:
        assert f"`{name}" in table or name.startswith(prefixes), name


# ---------------------------------------------------------------- issue 29 item 9: smaller DeepSpeed differences
def test_lamb_with_a_static_fp16_loss_scale_is_refused() -> None:
    from dscore.errors import ConfigError

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Lamb", "params": {"lr": 0.01}},
        "fp16": {"enabled": True, "loss_scale": 128},
    }
    with pytest.raises(ConfigError, match="Lamb requires dynamic loss scaling") as err:
        dscore.initialize(model=torch.nn.Linear(3, 1), config=config)
    assert "fp16.loss_scale" in str(err.value)
    config["fp16"] = {"enabled": True, "loss_scale": 0}
    engine, *_ = dscore.initialize(model=torch.nn.Linear(3, 1), config=config)
    engine.close()


@pytest.mark.parametrize("zenflow", [{}, {"topk_ratio": 0.1}])
def test_zenflow_as_deepspeed_enables_it_is_refused_with_sum(zenflow: dict) -> None:
    from dscore.config import load_config
    from dscore.errors import ConfigError

    config = {
        "train_batch_size": 2,
        "gradient_allreduce_op": "sum",
        "zero_optimization": {"stage": 2, "zenflow": zenflow},
    }
    with pytest.raises(ConfigError, match="zero_optimization.zenflow"):
        load_config(config, world_size=1)
