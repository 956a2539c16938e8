"""csv / tensorboard / wandb monitors: DeepSpeed layouts, rank-0 only, optional wandb import."""

from __future__ import annotations

import csv
import os
import sys
from types import SimpleNamespace

import pytest

from dscore.specs import resolve
from dscore_plugins.monitor.monitor import CsvMonitor, MonitorUnavailableError, TensorBoardMonitor, WandbMonitor
from dscore_plugins.monitor.plugin import dscore_register_monitors


def _section(tmp_path, enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(enabled=enabled, output_path=str(tmp_path), job_name="job1")


def test_csv_layout_one_file_per_event(tmp_path) -> None:
    mon = CsvMonitor(_section(tmp_path), rank=0)
    mon.write_events([("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 0.1, 8)])
    mon.write_events([("Train/Samples/train_loss", 1.5, 16)])
    mon.close()
    d = tmp_path / "job1"
    assert sorted(os.listdir(d)) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    with open(d / "Train_Samples_train_loss.csv", newline="") as fh:
        assert list(csv.reader(fh)) == [["step", "train_loss"], ["8", "2.5"], ["16", "1.5"]]


def test_only_rank_zero_and_only_when_enabled_write(tmp_path) -> None:
    CsvMonitor(_section(tmp_path / "r1"), rank=1).write_events([("a", 1.0, 1)])
    CsvMonitor(SimpleNamespace(enabled=False, output_path=str(tmp_path / "off"), job_name="j"), rank=0).write_events(
        [("a", 1.0, 1)]
    )
    TensorBoardMonitor(_section(tmp_path / "tb1"), rank=1).write_events([("a", 1.0, 1)])
    WandbMonitor(SimpleNamespace(enabled=True, project="p", group=None, team=None), rank=1).write_events(
        [("a", 1.0, 1)]
    )
    assert not (tmp_path / "r1").exists() and not (tmp_path / "off").exists() and not (tmp_path / "tb1").exists()


def test_tensorboard_scalars_read_back(tmp_path) -> None:
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = TensorBoardMonitor(_section(tmp_path), rank=0)
    mon.write_events([("Train/loss", torch.tensor(0.75), 4), ("Train/loss", 0.5, 8)])
    mon.close()
    acc = EventAccumulator(str(tmp_path / "job1"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/loss")] == [(4, 0.75), (8, 0.5)]


def test_wandb_missing_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(MonitorUnavailableError, match="pip install wandb"):
        WandbMonitor(SimpleNamespace(enabled=True, project="p", group=None, team=None), rank=0)


def test_wandb_logs_through_the_module(monkeypatch) -> None:
    calls: list = []
    fake = SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)) or object(),
        log=lambda data, step: calls.append(("log", data, step)),
        finish=lambda: calls.append(("finish",)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    mon = WandbMonitor(SimpleNamespace(enabled=True, project="proj", group="g", team="t"), rank=0)
    mon.write_events([("Train/loss", 1.25, 3)])
    mon.close()
    assert calls == [
        ("init", {"project": "proj", "group": "g", "entity": "t"}),
        ("log", {"Train/loss": 1.25}, 3),
        ("finish",),
    ]


def test_monitor_specs() -> None:
    specs = {s.name: s for s in dscore_register_monitors()}
    assert {n: s.config_key for n, s in specs.items()} == {
        "tensorboard": "tensorboard",
        "csv": "csv_monitor",
        "wandb": "wandb",
    }
    for s in specs.values():
        assert callable(resolve(s.factory))


def test_factory_accepts_the_config_section_model(tmp_path) -> None:
    mcfg = pytest.importorskip("dscore_plugins.monitor.config")
    from dscore.protocols import MonitorContext
    from dscore.testing.contexts import local_config, local_runtime

    section = mcfg.CsvMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="jobx")
    runtime = local_runtime()
    ctx = MonitorContext(config=local_config(runtime=runtime), section=section, runtime=runtime, path="csv_monitor")
    assert ctx.rank == 0
    mon = resolve("dscore_plugins.monitor.monitor:csv_monitor_factory")(ctx)
    mon.write_events([("x", 1.0, 1)])
    assert (tmp_path / "jobx" / "x.csv").exists()
