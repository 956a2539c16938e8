"""Manifest of the built-in precision plugin (torch-free: specs only)."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, PrecisionSpec

_MOD = "dscore_plugins.precision.precision"


@hookimpl
def dscore_register_precisions() -> list[PrecisionSpec]:
    """fp32 (the default, ``config_key=None``), fp16 and bf16 (enabled by their ds_config blocks)."""
    return [
        PrecisionSpec(name="fp32", config_key=None, factory=f"{_MOD}:build_fp32", description="full precision"),
        PrecisionSpec(
            name="fp16",
            config_key="fp16",
            factory=f"{_MOD}:build_fp16",
            description="fp16 with static or dynamic loss scaling (both DeepSpeed algorithms)",
        ),
        PrecisionSpec(
            name="bf16",
            config_key="bf16",
            aliases=("bfloat16",),
            factory=f"{_MOD}:build_bf16",
            description="bf16 without loss scaling; optional inf/NaN step skipping",
        ),
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``fp16``, ``bf16`` (legacy ``bfloat16``) and ``torch_autocast`` sections
    (models in :mod:`dscore_plugins.precision.config`)."""
    return [
        ConfigSectionSpec(
            name="fp16", model="dscore_plugins.precision.config:Fp16Config", description="fp16 and loss scaling"
        ),
        ConfigSectionSpec(
            name="bf16",
            aliases=("bfloat16",),
            model="dscore_plugins.precision.config:Bf16Config",
            description="bf16 training",
        ),
        ConfigSectionSpec(
            name="torch_autocast",
            model="dscore_plugins.precision.config:TorchAutocastConfig",
            description="torch.autocast in forward",
        ),
    ]
