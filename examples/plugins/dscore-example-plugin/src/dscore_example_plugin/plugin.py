"""Manifest of the example plugin: registration hooks only, nothing heavy imported."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import LRSchedulerSpec, OptimizerSpec


@hookimpl
def dscore_register_optimizers() -> list[OptimizerSpec]:
    return [
        OptimizerSpec(
            name="SignSGD",
            aliases=("sign_sgd",),
            factory="dscore_example_plugin.optim:SignSGD",
            params_model="dscore_example_plugin.config:SignSGDParams",
            description="sign of the momentum (signSGD, Bernstein et al. 2018)",
        )
    ]


@hookimpl
def dscore_register_lr_schedulers() -> list[LRSchedulerSpec]:
    return [
        LRSchedulerSpec(
            name="InverseSqrtLR",
            factory="dscore_example_plugin.sched:InverseSqrtLR",
            params_model="dscore_example_plugin.config:InverseSqrtLRParams",
            description="linear warm-up, then lr * sqrt(warmup / step)",
        )
    ]
