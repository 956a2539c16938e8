"""The checkpoint layouts are ``checkpoint_layout`` plugin units: save picks one by name through the registry
(unknown -> close matches, disabled -> the unit named), load detects it, and a disabled ``deepspeed`` unit
refuses DeepSpeed checkpoints naming the unit while the native layout keeps working."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import dscore
from dscore.errors import CheckpointError
from dscore.persistence import layouts
from dscore.persistence import savedir as S

CONFIG = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}}


def _engine(disable: list[str] | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    config = dict(CONFIG)
    if disable:
        config["plugins"] = {"disable": disable}
    engine, *_ = dscore.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    return engine


def test_registry_lists_both_builtin_layouts_in_detection_order() -> None:
    engine = _engine()
    try:
        assert layouts.layout_names(engine.runtime.registry)[:1] == ["deepspeed"]
        assert set(layouts.layout_names(engine.runtime.registry)) >= {"deepspeed", "dscore"}
    finally:
        engine.close()


def test_unknown_layout_gets_did_you_mean_naming_the_key(tmp_path) -> None:
    engine = _engine()
    try:
        engine.checkpoint_layout = "deepspeeed"
        with pytest.raises(CheckpointError, match=r"engine\.checkpoint_layout = 'deepspeeed'.*Did you mean 'deepspeed'"):
            engine.save_checkpoint(str(tmp_path))
        assert not os.listdir(tmp_path) or S.list_tags(str(tmp_path)) == []
    finally:
        engine.close()


def test_deepspeed_layout_roundtrip_then_disabled_unit_refuses_it(tmp_path) -> None:
    engine = _engine()
    engine.checkpoint_layout = "deepspeed"
    engine.save_checkpoint(str(tmp_path / "ds"))
    saved = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.close()
    tag_dir = tmp_path / "ds" / "global_step1"
    assert S.read_manifest(str(tag_dir))["layout"] == "deepspeed"
    assert (tag_dir / "mp_rank_00_model_states.pt").exists()

    # a DeepSpeed-written directory: the same files without dscore's manifest
    foreign = tmp_path / "foreign"
    shutil.copytree(tag_dir, foreign / "global_step1")
    (foreign / "global_step1" / "_COMPLETE").unlink()
    (foreign / "latest").write_text("global_step1")

    fresh = _engine()
    try:
        assert fresh.load_checkpoint(str(foreign))[0] is not None
        for k, v in fresh.module_state_dict().items():
            assert torch.equal(v, saved[k]), k
    finally:
        fresh.close()

    off = _engine(disable=["checkpoint_layout:deepspeed"])
    try:
        assert "deepspeed" not in off.runtime.registry.names("checkpoint_layout")
        for where in (tmp_path / "ds", foreign):  # dscore-written (manifest) and DeepSpeed-written (detected)
            with pytest.raises(CheckpointError, match=r"read by checkpoint_layout:deepspeed.*disabled"):
                off.load_checkpoint(str(where))
        off.checkpoint_layout = "deepspeed"
        with pytest.raises(CheckpointError, match=r"checkpoint_layout:deepspeed"):
            off.save_checkpoint(str(tmp_path / "refused"))
        off.checkpoint_layout = "dscore"  # the native layout is untouched
        off.save_checkpoint(str(tmp_path / "native"))
        assert off.load_checkpoint(str(tmp_path / "native"))[0].endswith(S.MODEL_FILE)
    finally:
        off.close()
