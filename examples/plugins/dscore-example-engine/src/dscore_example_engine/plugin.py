"""Manifest (torch-free): the ``ema`` engine and its ``ema`` config section."""

from __future__ import annotations

from dscore.protocols import hookimpl
from dscore.specs import ConfigSectionSpec, EngineSpec


@hookimpl
def dscore_register_engines() -> list[EngineSpec]:
    """The ``ema`` engine: chosen for any module when the ``ema`` block is enabled."""
    return [
        EngineSpec(
            name="ema",
            predicate="dscore_example_engine.engine:handles",
            factory="dscore_example_engine.engine:build",
            priority=50,
            description="standard training plus an exponential moving average of the weights",
        )
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``ema`` section."""
    return [ConfigSectionSpec(name="ema", model="dscore_example_engine.config:EmaConfig")]
