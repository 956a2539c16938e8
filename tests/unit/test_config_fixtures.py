"""Shared helpers of the config tests: a registry built from the built-in section plugins plus small
fake optimizer / scheduler / monitor plugins (no entry points, no torch)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from dscore import hookimpl
from dscore.config import load_config
from dscore.errors import ConfigError
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import ConfigSectionSpec, LRSchedulerSpec, OptimizerSpec

SECTION_PLUGINS = [
    ("zero", "dscore_plugins.zero.plugin"),
    ("precision", "dscore_plugins.precision.plugin"),
    ("monitors", "dscore_plugins.monitor.plugin"),
    ("comm", "dscore_plugins.comm.plugin"),
]


class AdamParams(BaseModel):
    """A strict params model standing in for an optimizer plugin's."""

    model_config = ConfigDict(extra="forbid")
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True


class WarmupParams(BaseModel):
    """A strict scheduler params model with a required key."""

    model_config = ConfigDict(extra="forbid")
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None
    warmup_num_steps: int = 1000
    total_num_steps: int


class FakeComponents:
    """Registers two optimizers (Adam with alias AdamW and a strict params model; SGD without one) and
    one scheduler."""

    @hookimpl
    def dscore_register_optimizers(self) -> list[OptimizerSpec]:
        return [
            OptimizerSpec(name="Adam", aliases=("AdamW",), factory="x:y", params_model=f"{__name__}:AdamParams"),
            OptimizerSpec(name="SGD", factory="x:y"),
        ]

    @hookimpl
    def dscore_register_lr_schedulers(self) -> list[LRSchedulerSpec]:
        return [LRSchedulerSpec(name="WarmupDecayLR", factory="x:y", params_model=f"{__name__}:WarmupParams")]


def make_registry(*extra: tuple[str, Any], sections: bool = True) -> Registry:
    """A registry with the built-in section plugins (optional), the fakes and ``extra`` plugins."""
    plugins: list[tuple[str, Any]] = list(SECTION_PLUGINS) if sections else []
    plugins.append(("fakes", FakeComponents()))
    plugins += list(extra)
    return Registry(create_plugin_manager(load_entry_points=False, extra_plugins=plugins))


def load(cfg: Any, **kwargs: Any) -> Any:
    """``load_config`` with the test registry (world size 1 unless given)."""
    kwargs.setdefault("registry", make_registry())
    return load_config(cfg, **kwargs)


def error_of(cfg: Any, **kwargs: Any) -> ConfigError:
    """The ConfigError ``load`` raises for ``cfg``."""
    with pytest.raises(ConfigError) as info:
        load(cfg, **kwargs)
    return info.value


def section_plugin(name: str, model: str, aliases: tuple[str, ...] = ()) -> object:
    """A plugin object registering one config section."""

    class _Plugin:
        @hookimpl
        def dscore_register_config_sections(self) -> list[ConfigSectionSpec]:
            return [ConfigSectionSpec(name=name, model=model, aliases=aliases)]

    return _Plugin()
