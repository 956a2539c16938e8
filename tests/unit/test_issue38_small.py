"""Issue 38 items 6 (the batch triangle's world size under AutoTP / an mpu), 8 (warnings where dscore, like
DeepSpeed, drops something: a padded ``attention_mask`` under Ulysses, a write inside a read-only
``GatheredParameters``) and 9b (the triangle's errors name the settings that would satisfy it)."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

import dscore
from dscore.cli.config import run as config_check
from dscore.config.batch import resolve_batch
from dscore.errors import ConfigError
from dscore.parallel.mesh import batch_world_size


# ------------------------------------------------------------------ item 6: which world size the triangle uses
def test_triangle_world_size_follows_deepspeed() -> None:
    tp = {"tensor_parallel": {"autotp_size": 2}}
    assert batch_world_size(4, tp, source="s")[0] == 4  # tensor-parallel ranks count (dist.get_world_size())
    assert batch_world_size(4, {"sequence_parallel_size": 2}, source="s")[0] == 2
    assert batch_world_size(8, {**tp, "sequence_parallel_size": 2}, source="s")[0] == 4
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: 3)
    assert batch_world_size(6, tp, source="s", mpu=mpu) == (3, "mpu.get_data_parallel_world_size() = 3 of 6 ranks (s)")
    sp_only = types.SimpleNamespace(get_sequence_parallel_world_size=lambda: 2)
    assert batch_world_size(6, {}, source="s", mpu=sp_only)[0] == 3
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        batch_world_size(3, tp, source="s")


def test_config_check_accepts_the_trainers_autotp_batch(tmp_path, capsys) -> None:
    """What the HF Trainer writes for 2 processes at tp 2 (processes x micro x accumulation); refused before."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 1, "tensor_parallel": {"autotp_size": 2}}))
    args = types.SimpleNamespace(file=str(path), world_size=2, json=True, lenient=False)
    assert config_check(args) == 0, capsys.readouterr()
    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 4


# ------------------------------------------------------------------ item 9b: the nearest valid settings
@pytest.mark.parametrize(
    ("raw", "world", "fix"),
    [
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, 2,
         "Set gradient_accumulation_steps to 2, or train_micro_batch_size_per_gpu to 4, or train_batch_size to 4."),
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, 4,
         "Set train_micro_batch_size_per_gpu to 1, or train_batch_size to 8."),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2,
         "Set train_batch_size to 8 or 16, or train_micro_batch_size_per_gpu to 5."),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 4}, 2,
         "Set train_batch_size to 8 or 16, or gradient_accumulation_steps to 5."),
        ({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 2}, 2, "Set train_batch_size to 4."),
        ({"train_batch_size": 7}, 2, "Set train_batch_size to 6 or 8 (a multiple of 2)"),
    ],
)
def test_triangle_errors_name_the_nearest_valid_settings(raw: dict, world: int, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(raw, world_size=world, world_size_source="test", source="<dict>")
    assert fix in str(err.value)
    for suggestion in _suggested(str(err.value), raw):  # each suggestion really satisfies the triangle
        resolve_batch(suggestion, world_size=world, world_size_source="test", source="<dict>")


def _suggested(message: str, raw: dict) -> list[dict]:
    text = message.split("Set ", 1)[1].split(" (a multiple")[0].rstrip(".")
    out = []
    for part in text.split(", or "):
        key, values = part.split(" to ")
        for value in values.split(" or "):
            out.append({**raw, key: int(value)})
    return out


# ------------------------------------------------------------------ item 8: warned once, only when due
def test_ulysses_adapter_warns_once_about_a_padded_mask(caplog, monkeypatch) -> None:
    from dscore_plugins.parallel.ulysses import data

    monkeypatch.setattr(data, "_PADDED_MASK_WARNED", False)
    adapter = data.UlyssesSPDataLoaderAdapter([], sp_rank=0, sp_group=None, sp_world_size=1, device="cpu")
    ids = torch.arange(8, device="cpu").reshape(2, 4)
    full = torch.ones(2, 4, dtype=torch.long, device="cpu")
    padded = full.clone()
    padded[1, 3] = 0
    caplog.set_level(logging.WARNING, logger="dscore.parallel.ulysses")
    for mask in (None, full, full):
        assert "attention_mask" not in adapter.shard({"input_ids": ids, "attention_mask": mask})
    assert not [r for r in caplog.records if "attention_mask" in r.getMessage()]
    for _ in range(3):
        adapter.shard({"input_ids": ids, "attention_mask": padded})
    warned = [r.getMessage() for r in caplog.records if "attention_mask" in r.getMessage()]
    assert len(warned) == 1 and "1 of 8 positions are 0" in warned[0] and "labels -100" in warned[0]


def _stage3_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = dscore.initialize(model=model, config=config)
    return engine


def test_read_only_gathered_parameters_warn_once_about_a_discarded_write(caplog, monkeypatch) -> None:
    import dscore.zero.init as zinit

    monkeypatch.setattr(zinit, "_DISCARDED_WRITE_WARNED", False)
    engine = _stage3_engine()
    params = list(engine.module.parameters())
    caplog.set_level(logging.WARNING, logger="dscore.zero")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "discarded in-place writes" in r.getMessage()]

    with dscore.zero.GatheredParameters(params):
        before = params[0].detach().clone()  # read only: no warning
    with dscore.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        params[1].add_(0.0)  # kept (modifier_rank=0): no warning
    assert warnings() == []
    for _ in range(2):
        with dscore.zero.GatheredParameters(params), torch.no_grad():
            params[0].add_(1.0)
    assert len(warnings()) == 1 and "0.weight" in warnings()[0] and "modifier_rank=0" in warnings()[0]
    with dscore.zero.GatheredParameters(params):
        assert torch.equal(params[0], before)  # DeepSpeed's semantics kept: the write was discarded
    engine.close()


def test_config_check_says_what_the_world_size_means_under_autotp(tmp_path, capsys) -> None:
    """Item 6: 'valid for a data-parallel world size of 2' was wrong under AutoTP (the data-parallel size is 1;
    2 is the process count the batch triangle multiplies by, as DeepSpeed)."""
    import json

    from dscore.cli.main import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                "tensor_parallel": {"autotp_size": 2}}))
    assert main(["config", "check", str(path), "--world-size", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "valid for 2 processes (from --world-size)" in first
    assert "data-parallel size 1 (tp 2 x sp 1), batch triangle world size 2" in first
