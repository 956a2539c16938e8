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
