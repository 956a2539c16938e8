"""``dscore config check``: text and JSON output, exit codes, no tracebacks."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from test_config_fixtures import make_registry

import dscore.config.load as load_module
from dscore.cli.main import main

SUMMARY_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_stage",
    "fp16_enabled",
    "bf16_enabled",
    "optimizer_type",
    "scheduler_type",
    "gradient_clipping",
    "offload_optimizer_device",
    "offload_param_device",
    "warnings",
}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Use the test registry; undo the stderr handler ``main``'s ``logging.basicConfig`` installs (it
    would point at a closed capture stream in the next test)."""
    monkeypatch.setattr(load_module, "_default_registry", lambda data: make_registry())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    handlers = logging.root.handlers[:]
    yield
    logging.root.handlers[:] = handlers


def _write(tmp_path: pathlib.Path, cfg: Any, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def test_json_summary(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        {
            "train_batch_size": 32,
            "zero_optimization": {"stage": 2, "cpu_offload": True},
            "bfloat16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}},
        },
    )
    assert main(["config", "check", path, "--world-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert SUMMARY_KEYS <= set(out)
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (
        32,
        8,
        1,
    )
    assert out["zero_stage"] == 2 and out["bf16_enabled"] is True and out["fp16_enabled"] is False
    assert out["optimizer_type"] == "AdamW" and out["scheduler_type"] == "WarmupDecayLR"
    assert out["gradient_clipping"] == 1.0
    assert out["offload_optimizer_device"] == "cpu" and out["offload_param_device"] is None
    assert any("cpu_offload" in w for w in out["warnings"]) and any("bfloat16" in w for w in out["warnings"])


def test_text_output(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "{train_micro_batch_size_per_gpu: 2, gradient_accumulation_steps: 3 // hjson\n}")
    assert main(["config", "check", path, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "train_batch_size = 12" in out and "valid" in out


def test_world_size_from_environment(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    path = _write(tmp_path, {"train_batch_size": 30})
    assert main(["config", "check", path, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "WORLD_SIZE=8" in error["message"]


def test_invalid_json_error_object(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 30})
    assert main(["config", "check", path, "--world-size", "4", "--json"]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert error["type"] == "ConfigError" and error["path"] == "train_batch_size"
    assert "not divisible" in error["message"]
    assert "Traceback" not in captured.out + captured.err


def test_several_errors_and_text_mode(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 8, "zero_optimisation": {"stage": 2}, "gradient_acumulation_steps": 2})
    assert main(["config", "check", path, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert {e["path"] for e in error["errors"]} == {"zero_optimisation", "gradient_acumulation_steps"}
    assert main(["config", "check", path]) == 2
    captured = capsys.readouterr()
    assert "did you mean 'zero_optimization'" in captured.err and "Traceback" not in captured.err
    assert main(["config", "check", path, "--lenient", "--json"]) == 0
    assert any("zero_optimisation" in w for w in json.loads(capsys.readouterr().out)["warnings"])


@pytest.mark.parametrize("content", ["{not json", "[1]", '{"a": 1, "a": 2}'])
def test_unparsable_files(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], content: str) -> None:
    path = _write(tmp_path, content)
    assert main(["config", "check", path, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "ConfigError" and error["message"]


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", "/nonexistent/ds.json", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "ConfigError"


def test_pending_auto_listed(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert main(["config", "check", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pending_auto"] == ["zero_optimization.reduce_bucket_size"]
