"""Manifest of the example ZeRO stage: registration hooks only (torch-free).

``default=False``: the built-in ``stage2`` stays the default for ``zero_optimization.stage: 2``; this
stage is chosen by name with ``zero_optimization.implementation: "count_bucket_stage2"``.
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, ZeroStageSpec


@hookimpl
def dscore_register_zero_stages() -> list[ZeroStageSpec]:
    return [
        ZeroStageSpec(
            name="count_bucket_stage2",
            stage=2,
            default=False,
            factory="dscore_example_zero.stage:CountBucketStage2",
            description="ZeRO-2 whose reduce buckets hold a fixed number of parameters (example_zero.params_per_bucket)",
        )
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    return [
        ConfigSectionSpec(
            name="example_zero",
            model="dscore_example_zero.config:ExampleZeroConfig",
            description="bucketing policy of the count_bucket_stage2 ZeRO stage",
        )
    ]
