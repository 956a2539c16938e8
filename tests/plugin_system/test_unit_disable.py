"""Disabling one unit (``kind:name``) instead of a whole plugin: DSCORE_DISABLE_PLUGINS and plugins.disable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dscore.errors import ComponentNotFoundError, PluginError
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry


def test_a_unit_is_disabled_and_the_rest_of_its_plugin_stays() -> None:
    manager = create_plugin_manager(disable=["op_builder:fused_adam"], environ={})
    ops = manager.records["ops"]
    assert ops.status == "active"
    assert "fused_adam" not in ops.provides["op_builder"]
    assert "cpu_adam" in ops.provides["op_builder"]
    assert ops.disabled_units == ["op_builder:fused_adam"]
    registry = Registry(manager)
    registry.get("op_builder", "cpu_adam")
    with pytest.raises(ComponentNotFoundError) as err:
        registry.get("op_builder", "FUSED_ADAM", config_path="ops")
    text = str(err.value)
    assert "op_builder:fused_adam" in text and "plugins.disable" in text and "DSCORE_DISABLE_PLUGINS" in text


def test_environment_variable_and_config_are_merged() -> None:
    manager = create_plugin_manager(disable=["lr_scheduler:warmuplr"], environ={"DSCORE_DISABLE_PLUGINS": "op_builder:cpu_adam"})
    assert manager.disabled_units == {"lr_scheduler:warmuplr", "op_builder:cpu_adam"}
    registry = Registry(manager)
    assert "cpu_adam" not in registry.names("op_builder")
    assert "WarmupLR" not in registry.names("lr_scheduler") and "warmuplr" not in [n.lower() for n in registry.names("lr_scheduler")]


def test_an_alias_disables_the_unit() -> None:
    manager = create_plugin_manager(disable=["lr_scheduler:WarmupLR"], environ={})
    assert not any(n.lower() == "warmuplr" for n in Registry(manager).names("lr_scheduler"))


@pytest.mark.parametrize("item", ["optimzer:adam", "op_builder:", ":fused_adam"])
def test_a_malformed_unit_is_refused(item: str) -> None:
    with pytest.raises(PluginError, match="kind:name"):
        create_plugin_manager(disable=[item], environ={})


def test_the_essential_unit_cannot_be_disabled() -> None:
    with pytest.raises(PluginError, match="essential"):
        create_plugin_manager(disable=["accelerator:cpu"], environ={})


def test_plugins_list_shows_disabled_units() -> None:
    env = {**os.environ, "DSCORE_DISABLE_PLUGINS": "op_builder:fused_adam"}
    proc = subprocess.run([sys.executable, "-m", "dscore", "plugins", "list", "--json"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["ops"]["disabled_units"] == ["op_builder:fused_adam"]
    assert "fused_adam" not in rows["ops"]["provides"]["op_builder"]
    proc = subprocess.run([sys.executable, "-m", "dscore", "plugins", "list"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "disabled units:" in proc.stdout and "op_builder:fused_adam" in proc.stdout.replace("│", " ").replace(" ", "")


def test_a_config_naming_a_disabled_optimizer_unit_is_refused_not_sent_to_torch() -> None:
    import torch

    import dscore
    from dscore.errors import ConfigError

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "plugins": {"disable": ["optimizer:adamw"]},
    }
    with pytest.raises(ConfigError) as err:
        dscore.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert "optimizer:adamw" in str(err.value) and "optimizer.type" in str(err.value)


def test_a_malformed_unit_in_the_config_names_the_key() -> None:
    import torch

    import dscore
    from dscore.errors import DscoreError

    with pytest.raises(DscoreError, match="kind:name"):
        dscore.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                               "plugins": {"disable": ["optimiser:adamw"]}})
