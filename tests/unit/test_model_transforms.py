"""The ``model_transform`` kind: the built-ins are registered units with their order, a disabled unit is
refused when the config needs it (naming ``kind:name``), and the plain path trains without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dscore
from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import ModelTransformSpec
from dscore.testing import run_distributed

BASE: dict[str, Any] = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _world_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-rank environment for the batch triangle; the refusals come before any rendezvous."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)


def test_built_in_transforms_are_units_in_order() -> None:
    registry = Registry(create_plugin_manager(environ={}))
    specs = sorted((s for s in registry.specs("model_transform") if isinstance(s, ModelTransformSpec)),
                   key=lambda s: s.order)
    assert [(s.name, s.order, s.config_key) for s in specs] == [
        ("autotp", 100, "tensor_parallel"),
        ("autoep", 200, "expert_parallel"),
        ("ulysses", 300, None),
        ("activation_checkpointing", 400, "activation_checkpointing"),
    ]
    assert registry.provider(specs[0]).name == "parallel"
    assert {"tensor_parallel", "expert_parallel", "activation_checkpointing"} <= set(registry.names("config_section"))


@pytest.mark.parametrize(
    ("unit", "extra"),
    [
        ("autotp", {"tensor_parallel": {"autotp_size": 2}}),
        ("ulysses", {"sequence_parallel_size": 2}),
        ("autoep", {"expert_parallel": {"enabled": True}}),
        ("activation_checkpointing", {"activation_checkpointing": {"cpu_checkpointing": True}}),
    ],
)
def test_a_disabled_unit_the_config_needs_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, unit: str, extra: dict[str, Any]
) -> None:
    _world_of_two(monkeypatch)
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", f"model_transform:{unit}")
    with pytest.raises(ComponentNotFoundError) as err:
        dscore.initialize(model=torch.nn.Linear(2, 2), config={**BASE, **extra})
    text = str(err.value)
    assert f"model_transform:{unit}" in text and "plugins.disable" in text and "this ds_config needs" in text


def test_a_disabled_unit_through_the_config_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _world_of_two(monkeypatch)
    cfg = {**BASE, "tensor_parallel": {"autotp_size": 2}, "plugins": {"disable": ["model_transform:autotp"]}}
    with pytest.raises(ComponentNotFoundError, match="model_transform:autotp"):
        dscore.initialize(model=torch.nn.Linear(2, 2), config=cfg)


def test_whole_plugin_disabled_refuses_the_mesh_degrees(monkeypatch: pytest.MonkeyPatch) -> None:
    _world_of_two(monkeypatch)
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "parallel")
    with pytest.raises(ConfigError) as err:
        dscore.initialize(model=torch.nn.Linear(2, 2), config={**BASE, "sequence_parallel_size": 2})
    assert err.value.path == "sequence_parallel_size" and "'sp' mesh dimension" in str(err.value)
    with pytest.raises(ConfigError, match="tensor_parallel"):  # the section itself is gated without its plugin
        dscore.initialize(model=torch.nn.Linear(2, 2), config={**BASE, "tensor_parallel": {"autotp_size": 2}})


def test_checkpoint_outside_a_runtime_follows_the_disabled_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    import dscore.checkpointing as ck

    def forget() -> None:  # names resolved by earlier tests are cached in the thin module
        for name in ck.__all__:
            ck.__dict__.pop(name, None)

    forget()
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "model_transform:activation_checkpointing")
    with pytest.raises(ComponentNotFoundError, match="model_transform:activation_checkpointing"):
        ck.checkpoint  # noqa: B018
    monkeypatch.delenv("DSCORE_DISABLE_PLUGINS")
    x = torch.ones(2, requires_grad=True)
    ck.checkpoint(lambda t: (t * 3).sum(), x).backward()  # no runtime: resolved over the installed plugins
    assert x.grad is not None and torch.equal(x.grad, torch.full((2,), 3.0))


def _train_plain(unit: str) -> list[float]:
    import os

    os.environ["DSCORE_DISABLE_PLUGINS"] = f"model_transform:{unit}"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    cfg = {"train_batch_size": 2, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}}
    engine, _, _, _ = dscore.initialize(model=model, config=cfg)
    before = engine.module.weight.detach().clone()
    loss = engine(torch.ones(1, 3)).sum()
    engine.backward(loss)
    engine.step()
    moved = (engine.module.weight.detach() - before).flatten().tolist()
    engine.close()
    return moved


@pytest.mark.parametrize("unit", ["autotp", "autoep", "ulysses", "activation_checkpointing"])
def test_two_ranks_train_the_plain_path_with_the_unit_disabled(unit: str) -> None:
    results = run_distributed(_train_plain, 2, unit)
    assert results[0] == results[1]
    assert results[0] == pytest.approx([-0.1, -0.1, -0.1])
