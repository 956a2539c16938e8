"""Training monitors configured by DeepSpeed's ``tensorboard``, ``csv_monitor`` and ``wandb`` blocks.

Each factory is called as ``factory(ctx)`` with a :class:`dscore.protocols.MonitorContext` whose ``section``
is the validated block (:mod:`dscore_plugins.monitor.config`: ``enabled``, ``output_path``, ``job_name`` for
tensorboard/csv; ``enabled``, ``group``, ``team``, ``project`` for wandb; defaults live there) and
``rank`` the global rank, and returns an object with ``write_events(events)`` and ``close()``. An event is
``(name, value, step)``: a tag such as ``"Train/Samples/train_loss"``, a float (0-dim tensors are
converted with ``.item()``) and an int step (DeepSpeed logs against ``global_samples``).

Only rank 0 writes anything (directories are not even created elsewhere), as in DeepSpeed's
``deepspeed/monitor/{tensorboard,csv_monitor,wandb}.py``. Layouts mirrored:

* csv: one file per event name ``<output_path>/<job_name>/<name with '/' and ' ' -> '_'>.csv``, header row
  ``step,<last '/'-component of the name>`` written the first time this monitor writes that file, then
  ``step,value`` rows appended.
* tensorboard: ``torch.utils.tensorboard.SummaryWriter(log_dir=<output_path>/<job_name>)``, one
  ``add_scalar(name, value, step)`` per event, flushed after every batch of events.
* wandb: ``wandb.init(project=..., group=..., entity=team)``, ``wandb.log({name: value}, step=step)``.

When ``output_path`` is empty the directory is ``<job_name>`` relative to the working directory
(DeepSpeed's ``os.path.join("", job_name)``).
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dscore.errors import DscoreError

if TYPE_CHECKING:
    from dscore.protocols import MonitorContext
    from dscore_plugins.monitor.config import CsvMonitorConfig, TensorBoardConfig, WandbConfig

__all__ = [
    "CsvMonitor",
    "MonitorUnavailableError",
    "TensorBoardMonitor",
    "WandbMonitor",
    "csv_monitor_factory",
    "tensorboard_monitor_factory",
    "wandb_monitor_factory",
]

log = logging.getLogger("dscore.monitor")

Event = tuple[str, float, int]


class MonitorUnavailableError(DscoreError, ImportError):
    """A monitor is enabled in ds_config but its library is not installed."""


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _log_dir(section: CsvMonitorConfig | TensorBoardConfig) -> str:
    return os.path.join(section.output_path, section.job_name)


class _Monitor:
    """Common rank/enabled gating: a monitor built on rank != 0 or disabled writes nothing."""

    def __init__(self, section: CsvMonitorConfig | TensorBoardConfig | WandbConfig, rank: int) -> None:
        self.rank = int(rank)
        self.enabled = bool(section.enabled) and self.rank == 0

    def write_events(self, events: Iterable[Event]) -> None:
        """Record ``(name, value, step)`` events (no-op unless enabled on rank 0)."""
        if self.enabled:
            self._write([(str(n), _as_float(v), int(s)) for n, v, s in events])

    def _write(self, events: list[Event]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release files/handles (idempotent)."""


class CsvMonitor(_Monitor):
    """DeepSpeed's csv layout: one csv per event name under ``<output_path>/<job_name>/``.

    Args:
        section: the ``csv_monitor`` block (``enabled``, ``output_path``, ``job_name``).
        rank: global rank; only rank 0 writes.
    """

    def __init__(self, section: CsvMonitorConfig, rank: int) -> None:
        super().__init__(section, rank)
        self.log_dir = _log_dir(section)
        self._headers_written: set[str] = set()
        if self.enabled:
            os.makedirs(self.log_dir or ".", exist_ok=True)

    @staticmethod
    def file_stem(name: str) -> str:
        """File name (without ``.csv``) for event ``name``: ``/`` and spaces become ``_``."""
        return name.replace("/", "_").replace(" ", "_")

    def _write(self, events: list[Event]) -> None:
        for name, value, step in events:
            stem = self.file_stem(name)
            path = os.path.join(self.log_dir, stem + ".csv")
            with open(path, "a+", newline="") as fh:
                writer = csv.writer(fh)
                if stem not in self._headers_written:
                    self._headers_written.add(stem)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])


class TensorBoardMonitor(_Monitor):
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` in ``<output_path>/<job_name>``.

    Args:
        section: the ``tensorboard`` block (``enabled``, ``output_path``, ``job_name``).
        rank: global rank; only rank 0 writes.

    Raises:
        MonitorUnavailableError: enabled on rank 0 but the ``tensorboard`` package is missing.
    """

    def __init__(self, section: TensorBoardConfig, rank: int) -> None:
        super().__init__(section, rank)
        self.log_dir = _log_dir(section)
        self.writer: Any = None
        if self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise MonitorUnavailableError(
                    "tensorboard.enabled is true but the 'tensorboard' package is not installed "
                    "(pip install tensorboard), or set tensorboard.enabled to false."
                ) from exc
            self.writer = SummaryWriter(log_dir=self.log_dir or None)

    def _write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbMonitor(_Monitor):
    """Weights & Biases logging (the ``wandb`` package is imported only when enabled on rank 0).

    Args:
        section: the ``wandb`` block (``enabled``, ``group``, ``team``, ``project`` default ``"deepspeed"``).
        rank: global rank; only rank 0 logs.

    Raises:
        MonitorUnavailableError: enabled on rank 0 but ``wandb`` is not installed.
    """

    def __init__(self, section: WandbConfig, rank: int) -> None:
        super().__init__(section, rank)
        self.run: Any = None
        self._wandb: Any = None
        if self.enabled:
            try:
                import wandb
            except ImportError as exc:
                raise MonitorUnavailableError(
                    "wandb.enabled is true in ds_config but the 'wandb' package is not installed. "
                    "Install it (pip install wandb) or set wandb.enabled to false."
                ) from exc
            self._wandb = wandb
            self.run = wandb.init(
                project=section.project,
                group=section.group,
                entity=section.team,
            )

    def _write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        if self._wandb is not None and self.run is not None:
            self._wandb.finish()
            self.run = None


def csv_monitor_factory(ctx: MonitorContext[CsvMonitorConfig]) -> CsvMonitor:
    """MonitorSpec factory for ``csv_monitor``."""
    return CsvMonitor(ctx.section, ctx.rank)


def tensorboard_monitor_factory(ctx: MonitorContext[TensorBoardConfig]) -> TensorBoardMonitor:
    """MonitorSpec factory for ``tensorboard``."""
    return TensorBoardMonitor(ctx.section, ctx.rank)


def wandb_monitor_factory(ctx: MonitorContext[WandbConfig]) -> WandbMonitor:
    """MonitorSpec factory for ``wandb``."""
    return WandbMonitor(ctx.section, ctx.rank)
