"""The ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` sections (torch-free; DeepSpeed defaults).

Enabling a section needs an installed monitor plugin for it (``dscore.config.checks``); dscore's built-in
monitors cover tensorboard, csv_monitor and wandb, so ``comet.enabled: true`` is refused.
"""

from __future__ import annotations

from pydantic import Field

from dscore.config.base import PositiveInt, SectionModel, no_effect

__all__ = ["TensorBoardConfig", "CsvMonitorConfig", "WandbConfig", "CometConfig"]


class TensorBoardConfig(SectionModel):
    """``tensorboard``: write scalars with TensorBoard's SummaryWriter (rank 0)."""

    enabled: bool = False
    """Write TensorBoard events."""
    output_path: str = ""
    """Directory of the event files (``""`` = ``./runs``-style default of the monitor)."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this run."""


class CsvMonitorConfig(SectionModel):
    """``csv_monitor``: one CSV file per logged event name (rank 0)."""

    enabled: bool = False
    """Write CSV files."""
    output_path: str = ""
    """Directory of the CSV files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this run."""


class WandbConfig(SectionModel):
    """``wandb``: log to Weights & Biases (rank 0; needs the ``wandb`` package)."""

    enabled: bool = False
    """Log to W&B."""
    group: str | None = None
    """W&B run group."""
    team: str | None = None
    """W&B entity (team)."""
    project: str = "deepspeed"
    """W&B project."""


_NO_COMET = "dscore has no Comet monitor (comet.enabled: true is refused)"


class CometConfig(SectionModel):
    """``comet``: log to Comet ML (no built-in dscore monitor yet: enabling it is refused)."""

    enabled: bool = False
    """Log to Comet."""
    samples_log_interval: PositiveInt = Field(100, json_schema_extra=no_effect(_NO_COMET))
    """Log every N samples."""
    project: str | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Comet project."""
    workspace: str | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Comet workspace."""
    api_key: str | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Comet API key (prefer the COMET_API_KEY variable)."""
    experiment_name: str | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Name of the experiment."""
    experiment_key: str | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Key of an existing experiment to continue."""
    online: bool | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Log online (true) or offline (false)."""
    mode: str | None = Field(None, json_schema_extra=no_effect(_NO_COMET))
    """Comet start mode (``"get"``, ``"create"``, ``"get_or_create"``)."""
