"""Manifest of the built-in monitors (torch-free: specs only)."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, MonitorSpec

_MOD = "dscore_plugins.monitor.monitor"


@hookimpl
def dscore_register_monitors() -> list[MonitorSpec]:
    """tensorboard, csv and wandb, each configured and enabled by its DeepSpeed ds_config block."""
    return [
        MonitorSpec(
            name="tensorboard",
            config_key="tensorboard",
            factory=f"{_MOD}:tensorboard_monitor_factory",
            description="scalars via torch.utils.tensorboard (rank 0)",
        ),
        MonitorSpec(
            name="csv",
            config_key="csv_monitor",
            factory=f"{_MOD}:csv_monitor_factory",
            description="one csv per event under output_path/job_name (rank 0)",
        ),
        MonitorSpec(
            name="wandb",
            config_key="wandb",
            factory=f"{_MOD}:wandb_monitor_factory",
            description="Weights & Biases (optional dependency, rank 0)",
        ),
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The monitor sections (models in :mod:`dscore_plugins.monitor.config`)."""
    mod = "dscore_plugins.monitor.config"
    return [
        ConfigSectionSpec(name="tensorboard", model=f"{mod}:TensorBoardConfig", description="TensorBoard monitor"),
        ConfigSectionSpec(name="csv_monitor", model=f"{mod}:CsvMonitorConfig", description="CSV monitor"),
        ConfigSectionSpec(name="wandb", model=f"{mod}:WandbConfig", description="Weights & Biases monitor"),
        ConfigSectionSpec(name="comet", model=f"{mod}:CometConfig", description="Comet monitor (not implemented)"),
    ]
