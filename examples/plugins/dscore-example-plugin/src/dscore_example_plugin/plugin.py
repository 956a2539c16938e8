"""Manifest of the example plugin: registration hooks only, nothing heavy imported.

Everything here is a public dscore name (``dscore.hookimpl``, ``dscore.specs``); the factories named by
import string receive typed contexts (``dscore.protocols.OptimizerContext`` / ``SchedulerContext``).
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import LRSchedulerSpec, OptimizerSpec


@hookimpl
def dscore_register_optimizers() -> list[OptimizerSpec]:
    return [
        OptimizerSpec(
            name="SignSGD",
            aliases=("sign_sgd",),
            factory="dscore_example_plugin.optim:build_sign_sgd",
            params_model="dscore_example_plugin.config:SignSGDParams",
            # element-wise update: correct over ZeRO partitions, so a client SignSGD needs no
            # zero_allow_untested_optimizer either (exact class)
            zero_supported=True,
            classes=("dscore_example_plugin.optim:SignSGD",),
            description="sign of the momentum (signSGD, Bernstein et al. 2018)",
        )
    ]


@hookimpl
def dscore_register_lr_schedulers() -> list[LRSchedulerSpec]:
    return [
        LRSchedulerSpec(
            name="InverseSqrtLR",
            factory="dscore_example_plugin.sched:build_inverse_sqrt_lr",
            params_model="dscore_example_plugin.config:InverseSqrtLRParams",
            description="linear warm-up, then lr * sqrt(warmup / step)",
        )
    ]
