"""ZeRO-3 leaf-module helpers (``dscore.zero``) and the ``zero_optimization.leaf_module`` block: DeepSpeed's
names and semantics (flag ``_z3_leaf``; classes by type, class name or qualified name)."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from dscore.zero import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from dscore.zero.leaf import apply_leaf_module_config


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()
        self.head = nn.Linear(2, 2)


def test_set_get_unset_by_type_and_name() -> None:
    net = Net()
    assert set_z3_leaf_modules(net, [Block]) == [net.a, net.b]
    assert get_z3_leaf_modules(net) == [net.a, net.b] and z3_leaf_module(net.a) and not z3_leaf_module(net.head)
    assert unset_z3_leaf_modules(net, ["Block"]) == [net.a, net.b]
    assert get_z3_leaf_modules(net) == []
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    assert set_z3_leaf_modules(net, [qualified]) == [net.a, net.b]


def test_nothing_matched_and_bad_entries() -> None:
    net = Net()
    with pytest.raises(ValueError, match="no module of class"):
        set_z3_leaf_modules(net, ["MixtralSparseMoeBlock"])
    assert set_z3_leaf_modules(net, ["MixtralSparseMoeBlock"], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="module classes or class names"):
        set_z3_leaf_modules(net, [3])  # type: ignore[list-item]


def test_config_block_classes_names_suffixes(caplog: pytest.LogCaptureFixture) -> None:
    from dscore_plugins.zero.config import LeafModuleConfig

    cfg = LeafModuleConfig.model_validate({"classes": "Block", "names": ["head", "nope"], "name_suffixes": ["experts.1"]})
    assert cfg.classes == ["Block"]  # a single string is a one-element list
    net = Net()
    with caplog.at_level(logging.WARNING, logger="dscore.zero"):
        found = apply_leaf_module_config(net, cfg)
    assert found == [net.a, net.b, net.head, net.a.experts[1], net.b.experts[1]]
    assert "zero_optimization.leaf_module.names[1] = 'nope' matches no module" in caplog.text
    # DeepSpeed's defaults (transformers' MoE blocks) match nothing here and are not reported
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscore.zero"):
        assert apply_leaf_module_config(Net(), LeafModuleConfig()) == []
    assert caplog.text == ""
    assert LeafModuleConfig().classes[0] == "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"
