"""The ds_config model: pydantic v2, torch-free.

Public API::

    from dscore.config import load_config, DscoreConfig, ConfigError
    cfg = load_config("ds_config.json", world_size=4)
    cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage, cfg.fp16.enabled, cfg.warnings

Plugins declare their sections with :class:`dscore.config.base.SectionModel` (or the settings in
:data:`dscore.config.base.SECTION_MODEL_CONFIG`) and register them with
``dscore_register_config_sections``. See :mod:`dscore.config.load` for the loading steps and
:mod:`dscore.config.keys` for what happens to every DeepSpeed key dscore does not implement.
"""

from __future__ import annotations

from typing import Any

from dscore.config.arguments import add_config_arguments
from dscore.config.base import (
    MODEL_AUTO_FORMULAS,
    SECTION_MODEL_CONFIG,
    Float,
    Int,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SectionModel,
)
from dscore.config.load import load_config
from dscore.config.model import (
    CheckpointConfig,
    DataTypesConfig,
    DscoreConfig,
    OptimizerConfig,
    PluginsConfig,
    SchedulerConfig,
    build_config_model,
)
from dscore.errors import ConfigError

__all__ = [
    "load_config",
    "DscoreConfig",
    "ConfigError",
    "add_config_arguments",
    "build_config_model",
    "SectionModel",
    "SECTION_MODEL_CONFIG",
    "MODEL_AUTO_FORMULAS",
    "Int",
    "PositiveInt",
    "NonNegativeInt",
    "Float",
    "PositiveFloat",
    "NonNegativeFloat",
    "OptimizerConfig",
    "SchedulerConfig",
    "CheckpointConfig",
    "DataTypesConfig",
    "PluginsConfig",
    "ActivationCheckpointingConfig",
]


def __getattr__(name: str) -> Any:
    # the section model of the parallel plugin's activation_checkpointing unit, resolved on first access
    if name == "ActivationCheckpointingConfig":
        from dscore.config.activation_checkpointing import ActivationCheckpointingConfig

        return ActivationCheckpointingConfig
    raise AttributeError(f"module 'dscore.config' has no attribute {name!r}")
