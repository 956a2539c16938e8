"""The config-key audit (issue 29, Build): every model field is read somewhere or marked warned/refused,
``docs/config-keys.md`` is current, and every key of items 2-4 is either implemented or named by
``dscore config check``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from dscore.config.audit import (
    DOC_PATH,
    REGENERATE,
    _model_rows,
    audit,
    render_markdown,
    stale_keys,
    statuses,
    unread_fields,
)
from dscore.config.base import no_effect, not_implemented

FIX = (
    "read it where it takes effect, or mark it in its model with json_schema_extra=no_effect(reason) "
    "(a tuning knob: warned when set) or not_implemented(reason) (changes training: a non-default value is "
    f"refused); both are in dscore.config.base. Then run `{REGENERATE}`."
)


@pytest.fixture(scope="module")
def rows() -> tuple[str, list]:
    return audit()


def test_no_config_field_is_accepted_and_ignored(rows: tuple[str, list]) -> None:
    unread = unread_fields(rows[1])
    assert not unread, "config fields read by nothing outside their model and not marked warned/refused:\n" + "\n".join(
        f"  {r.path} ({r.detail})" for r in unread
    ) + f"\nFor each: {FIX}"


def test_config_keys_document_is_current(rows: tuple[str, list]) -> None:
    """Every key's presence and status in docs/config-keys.md matches the audit (the 'where' column may
    drift as code moves)."""
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
    stale = stale_keys(current, *rows)
    assert not stale, (
        f"{DOC_PATH.name} is out of date for {stale}: run `{REGENERATE}` and commit docs/config-keys.md"
    )
    assert len(statuses(render_markdown(*rows))) == len(rows[1])  # the parser reads every row back


def test_every_deepspeed_key_has_a_status(rows: tuple[str, list]) -> None:
    data = json.loads((Path(__import__("dscore").__file__).parent / "config" / "deepspeed_keys.json").read_text())
    assert data["deepspeed"] == "0.19.8"
    by_path = {r.path: r for r in rows[1]}
    missing = [k for k in data["keys"] if k not in by_path]
    assert not missing, missing
    # "unknown" is a refusal too (strict validation names the key); "unread" never appears for DeepSpeed keys
    allowed = {"implemented", "warned", "refused", "migrated", "block", "unknown"}
    assert all(by_path[k].status in allowed for k in data["keys"]), [(k, by_path[k].status) for k in data["keys"]]


class _Probe(BaseModel):
    h29_probe_never_read: int = 0
    h29_probe_marked: int = Field(0, json_schema_extra=no_effect("probe"))
    h29_probe_refused: int = Field(0, json_schema_extra=not_implemented("probe"))


def test_audit_flags_an_unread_field() -> None:
    """The check can fail: a field nothing reads and nothing marks is reported as unread."""
    out: dict = {}
    _model_rows(_Probe, "probe", out)
    assert out["probe.h29_probe_never_read"].status == "unread"
    assert out["probe.h29_probe_marked"].status == "warned"
    assert out["probe.h29_probe_refused"].status == "refused"


ITEMS_2_TO_4 = {
    "train_batch_size": 8,
    "bf16": {"enabled": True},
    "gradient_allreduce_op": "sum",
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "communication_data_type": "fp32",
    "zero_optimization": {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 2,
        "offload_optimizer": {
            "device": "cpu", "ratio": 0.3, "super_offload": True, "fast_init": True, "cpuadam_cores_perc": 0.5,
        },
        "load_from_fp32_weights": False,
        "elastic_checkpoint": True,
        "ignore_unused_parameters": False,
        "use_multi_rank_bucket_allreduce": False,
        "legacy_stage1": True,
        "parameter_alignment": True,
        "stage3_model_persistence_threshold": 1000,
        "stage3_module_granularity_threshold": 100,
        "stage3_use_all_reduce_for_fetch_params": True,
        "stage3_allgather_sequential": True,
        "memory_efficient_linear": False,
        "override_module_apply": False,
        "enable_sanity_checks": True,
        "round_robin_gradients": True,
    },
}  # fmt: skip


def _paths(block: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in block.items():
        path = f"{prefix}.{k}" if prefix else k
        out += _paths(v, path) if isinstance(v, dict) else [path]
    return out


def test_config_check_names_every_key_it_does_not_implement(tmp_path: Path, rows: tuple[str, list]) -> None:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(ITEMS_2_TO_4))
    proc = subprocess.run(
        [sys.executable, "-m", "dscore", "config", "check", str(cfg)], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    status = {r.path: r.status for r in rows[1]}
    for path in _paths(ITEMS_2_TO_4):
        if path in ("train_batch_size", "bf16.enabled", "zero_optimization.stage", "zero_optimization.offload_optimizer.device"):
            continue
        if status[path] == "implemented":
            continue  # nothing to say: it does what DeepSpeed's does
        assert path in out, (path, status[path], out)
    # the refused ones are errors, the warned ones warnings
    for path in ("zero_optimization.offload_optimizer.ratio", "zero_optimization.offload_optimizer.super_offload"):
        assert f"{path} = " in out and "not implemented" in out, path
    assert "zero_optimization.offload_optimizer.fast_init = true has no effect" in out
