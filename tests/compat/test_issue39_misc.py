"""Issue 39: DeepSpeed 0.19.8's ``runtime.constants``, ``zero_to_fp32`` conversions, checkpoint tag rules, ZeRO config
legacy keys and engine/optimizer names on dscore, by behaviour."""

from __future__ import annotations

import deepspeed
import torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _config(**extra: object) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    cfg.update(extra)
    return cfg


def test_runtime_constants_name_the_keys_and_defaults_dscore_config_uses() -> None:
    from deepspeed.runtime import constants as c

    from dscore.config.model import DscoreConfig

    fields = DscoreConfig.model_fields
    checked = 0
    for name in dir(c):
        key = getattr(c, name[: -len("_DEFAULT")], None) if name.endswith("_DEFAULT") else None
        if isinstance(key, str) and key in fields and fields[key].is_required() is False:
            assert fields[key].default == getattr(c, name), name
            checked += 1
    assert checked >= 10
    assert (c.GRADIENT_CLIPPING, c.GRADIENT_CLIPPING_DEFAULT, c.LOG_LEVEL_DEFAULT) == ("gradient_clipping", 1.0, None)
    assert c.CHECKPOINT_TAG_VALIDATION_DEFAULT == c.ValidationMode.WARN == "WARN"
    assert set(c.CHECKPOINT_TAG_VALIDATION_MODES) == {"WARN", "IGNORE", "FAIL"}
    engine, *_ = deepspeed.initialize(model=_model(), config=_config())
    assert engine.gradient_clipping() == c.GRADIENT_CLIPPING_DEFAULT


class _Tied(torch.nn.Module):
    """Tied a.weight / b.weight, a frozen layer and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.frozen = torch.nn.Linear(8, 2)
        self.frozen.requires_grad_(False)
        self.register_buffer("index", torch.arange(3, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.b(self.a(x)))


def test_zero_to_fp32_conversions_write_deepspeeds_files_with_tied_weights_kept_tied(tmp_path) -> None:
    import json

    import pytest
    from deepspeed.utils import zero_to_fp32 as z

    from dscore.errors import CheckpointError

    for stage in (2, 3):
        engine, *_ = deepspeed.initialize(model=_Tied(), config=_config(zero_optimization={"stage": stage}))
        engine.backward(engine(torch.ones(2, 8)).sum())
        engine.step()
        ckpt = tmp_path / f"ckpt{stage}"
        engine.save_checkpoint(str(ckpt), tag="t")
        full = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
        assert full["a.weight"] is full["b.weight"] and full["a.weight"].dtype == torch.float32
        assert set(full) == {"a.weight", "a.bias", "b.weight", "b.bias", "frozen.weight", "frozen.bias", "index"}
        lazy = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t", lazy_mode=True)
        assert all(torch.equal(lazy[k].contiguous(), full[k]) for k in full)
        trainable = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, "t", exclude_frozen_parameters=True)
        assert set(full) - set(trainable) == {"frozen.weight", "frozen.bias"}

        out = tmp_path / f"fp32_{stage}"
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, tag="t")
        assert sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin"]
        loaded = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert id(loaded["a.weight"]) == id(loaded["b.weight"])
        assert all(torch.equal(loaded[k], full[k]) for k in full)
        _Tied().load_state_dict(loaded, strict=True)

    # DeepSpeed's newer name: any output dtype, Hugging Face shards and index, safetensors
    shards = tmp_path / "shards"
    z.convert_zero_checkpoint_to_state_dict(ckpt, shards, dtype="bf16", max_shard_size=100, tag="t")
    index = json.loads((shards / "pytorch_model.bin.index.json").read_text())
    files = sorted(p.name for p in shards.iterdir() if p.suffix == ".bin")
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files) and set(index["weight_map"]) == set(full)
    assert index["weight_map"]["a.weight"] == index["weight_map"]["b.weight"]
    merged: dict = {}
    for f in files:
        merged.update(torch.load(shards / f, weights_only=True))
    assert merged["a.weight"].dtype == torch.bfloat16 and merged["index"].dtype == torch.int64
    assert torch.equal(merged["a.bias"], full["a.bias"].to(torch.bfloat16))
    with pytest.raises(CheckpointError, match="tied weights"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "st", safe_serialization=True, tag="t")
    with pytest.raises(CheckpointError, match="bf16"):
        z.convert_zero_checkpoint_to_state_dict(ckpt, tmp_path / "x", dtype="int8", tag="t")
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 1}))
    engine.save_checkpoint(str(tmp_path / "plain"))
    z.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "plain", tmp_path / "st", safe_serialization=True)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "st" / "model.safetensors"))) == set(engine.module.state_dict())


def test_checkpoint_tag_validation_default_tag_and_save_dir_errors_as_deepspeed(tmp_path) -> None:
    from misc_jobs import tag_rules  # tests/compat is on sys.path: pytest's prepend import mode

    from dscore.testing import run_distributed

    for seen in run_distributed(tag_rules, 2, str(tmp_path), timeout=240):
        assert seen["Fail"] == ("AssertionError", True, True)
        assert seen["Warn"] == seen["Ignore"] == ["latest", "tag-0"]  # rank 0's tag (DeepSpeed: one per tag)
        assert seen["default"] == (["global_step1", "latest"], "global_step1")
        assert seen["None"] == seen["''"] == ("ValueError", True)
    ms = torch.load(tmp_path / "default" / "global_step1" / "mp_rank_00_model_states.pt", weights_only=True)
    assert ms["optimizer"]["param_groups"][0]["params"] == [0, 1] and set(ms["optimizer"]["state"]) == {0, 1}


def test_deepspeed_config_error_is_what_dscore_raises_for_a_bad_tag_validation() -> None:
    import pytest
    from deepspeed.runtime.config import DeepSpeedConfigError

    from dscore.errors import ConfigError

    assert deepspeed.DeepSpeedConfigError is DeepSpeedConfigError
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="tag_validation") as info:
        deepspeed.initialize(model=_model(), config=_config(checkpoint={"tag_validation": "foo"}))
    assert isinstance(info.value, ConfigError)


def test_stage0_save_in_deepspeeds_layout_round_trips_the_optimizer(tmp_path) -> None:
    x = torch.randn(2, 4, device="cpu")
    engines = []
    for _ in range(2):
        engine, *_ = deepspeed.initialize(model=_model(), config=_config())
        engines.append(engine)
    first, second = engines
    for _ in range(2):
        first.backward(first(x).sum())
        first.step()
    first.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    assert sorted(p.name for p in (tmp_path / "global_step2").iterdir()) == ["_COMPLETE", "mp_rank_00_model_states.pt"]
    _, client = second.load_checkpoint(str(tmp_path))
    assert client == {"epoch": 3} and second.global_steps == 2
    for engine in engines:
        engine.backward(engine(x).sum())
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(first.module.parameters(), second.module.parameters()))


def test_zero_config_built_directly_takes_deepspeeds_deprecated_keys_and_warns() -> None:
    import logging

    import pydantic
    import pytest
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dscore")
    logger.addHandler(handler)
    try:
        cfg = DeepSpeedZeroConfig(cpu_offload_param=True, cpu_offload=True, cpu_offload_use_pin_memory=False)
        assert isinstance(cfg.offload_param, DeepSpeedZeroOffloadParamConfig) and cfg.offload_param.device == "cpu"
        assert isinstance(cfg.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
        assert cfg.offload_optimizer.device == "cpu"
        assert DeepSpeedZeroConfig(cpu_offload=False).offload_optimizer is None
        assert sum("deprecated" in m and "cpu_offload" in m for m in records) == 4
        records.clear()
        DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
        assert not records
        DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
        assert any("elastic checkpointing is deprecated" in m.lower() for m in records)
    finally:
        logger.removeHandler(handler)
    with pytest.raises(pydantic.ValidationError, match="cannot be given together"):
        DeepSpeedZeroConfig(cpu_offload=True, offload_optimizer={"device": "cpu"})
    # the loader path still migrates once (no key is seen twice)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": 2, "cpu_offload": True}))
    assert engine.config.zero_optimization.offload_optimizer.device == "cpu"


def test_isinstance_of_deepspeeds_zero_optimizer_classes_follows_the_engines_stage() -> None:
    import pytest
    from deepspeed._not_provided import NotProvidedError
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    seen = {}
    for stage in (0, 1, 2, 3):
        engine, optimizer, *_ = deepspeed.initialize(model=_model(), config=_config(zero_optimization={"stage": stage}))
        assert optimizer is engine.optimizer
        seen[stage] = (isinstance(engine.optimizer, DeepSpeedZeroOptimizer),
                       isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3))
    assert seen == {0: (False, False), 1: (True, False), 2: (True, False), 3: (False, True)}
    assert not isinstance(torch.optim.SGD(_model().parameters(), lr=0.1), DeepSpeedZeroOptimizer_Stage3)
    assert not isinstance(object(), DeepSpeedZeroOptimizer)
    no_opt, *_ = deepspeed.initialize(model=_model(), config={"train_micro_batch_size_per_gpu": 2,
                                                               "zero_optimization": {"stage": 3}})
    assert not isinstance(no_opt.optimizer, DeepSpeedZeroOptimizer_Stage3)  # DeepSpeed: DeepSpeedZeRoOffload
    with pytest.raises(NotProvidedError, match="zero_stage:stage3"):
        DeepSpeedZeroOptimizer_Stage3(None)
