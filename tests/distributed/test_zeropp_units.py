"""ZeRO++ options as ``zero_feature`` units (the built-in ``zeropp`` plugin): each is looked up only when its
``zero_optimization`` key asks for it, a disabled one refuses that config naming ``zero_feature:<name>``, and
plain ZeRO-3 is unchanged with all of them disabled. One process (world 1): the lookups come before any
collective, and training without the units must equal training with them present."""

from __future__ import annotations

from typing import Any

import pytest

from dscore.errors import ComponentNotFoundError


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _config(zero: dict[str, Any], disable: list[str] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    if disable is not None:
        cfg["plugins"] = {"disable": disable}
    return cfg


def _losses(cfg: dict[str, Any], steps: int = 3) -> list[float]:
    import torch
    import torch.nn.functional as F

    import dscore

    engine, *_ = dscore.initialize(model=_model(), config=cfg)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
    out = []
    for _ in range(steps):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    engine.close()
    return out


def test_the_zeropp_plugin_registers_three_zero_features() -> None:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    manager = create_plugin_manager(environ={})
    assert manager.records["zeropp"].provides["zero_feature"] == ["hpz", "qgz", "qwz"]
    registry = Registry(manager)
    keys = {n: registry.get("zero_feature", n).config_keys for n in ("hpz", "qgz", "qwz")}  # type: ignore[attr-defined]
    assert keys == {"hpz": ("zero_hpz_partition_size",), "qgz": ("zero_quantized_gradients",),
                    "qwz": ("zero_quantized_weights", "zero_quantized_nontrainable_weights")}  # fmt: skip
    for n in keys:  # every factory imports
        assert callable(registry.load(registry.get("zero_feature", n)))


@pytest.mark.parametrize(
    "name, zero",
    [
        ("hpz", {"zero_hpz_partition_size": 2}),
        ("qwz", {"zero_quantized_weights": True}),
        ("qwz", {"zero_quantized_nontrainable_weights": True}),
        ("qgz", {"zero_quantized_gradients": True}),
    ],
)
def test_a_disabled_zeropp_unit_refuses_the_config_that_needs_it(name: str, zero: dict[str, Any]) -> None:
    import dscore

    key = next(iter(zero))
    with pytest.raises(ComponentNotFoundError) as err:
        dscore.initialize(model=_model(), config=_config(zero, disable=[f"zero_feature:{name}"]))
    text = str(err.value)
    assert f"zero_feature:{name}" in text and f"zero_optimization.{key}" in text, text
    assert "plugins.disable" in text and "DSCORE_DISABLE_PLUGINS" in text, text


def test_disabling_the_zeropp_plugin_names_it() -> None:
    import dscore

    with pytest.raises(ComponentNotFoundError, match="zeropp"):
        dscore.initialize(model=_model(), config=_config({"zero_quantized_weights": True}, disable=["zeropp"]))


def test_plain_zero3_trains_the_same_with_every_zeropp_unit_disabled() -> None:
    every = ["zero_feature:hpz", "zero_feature:qwz", "zero_feature:qgz"]
    assert _losses(_config({}, disable=every)) == _losses(_config({}))
    assert _losses(_config({}, disable=["zeropp"])) == _losses(_config({}))


def test_a_disabled_unit_leaves_the_others_working() -> None:
    """qwZ alone, with hpZ and qgZ disabled: the weights' training gathers are quantized (the unit's gather
    strategy is qwZ's), and the losses differ from exact ZeRO-3's but stay close."""
    exact = _losses(_config({}))
    quantized = _losses(_config({"zero_quantized_weights": True}, disable=["zero_feature:hpz", "zero_feature:qgz"]))
    assert quantized != exact
    assert all(abs(q - e) <= 0.05 * abs(e) for q, e in zip(quantized, exact)), (quantized, exact)
