"""Manifest of the built-in ZeRO++ plugin (torch-free: specs only).

Three units of kind ``zero_feature``, each an option of ZeRO stage 3 that the stage looks up by name when
its ``zero_optimization`` key is set (so ``DSCORE_DISABLE_PLUGINS=zero_feature:hpz`` refuses
``zero_hpz_partition_size: 2`` naming the unit, and leaves plain ZeRO-3 as it is):

* ``hpz``: hierarchical partitioning (:mod:`dscore_plugins.zeropp.hpz`);
* ``qwz``: quantized weights, int8 training gathers (:mod:`dscore_plugins.zeropp.qwz`);
* ``qgz``: quantized gradients, int4 two-level reduce-scatter (:mod:`dscore_plugins.zeropp.qgz`).
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ZeroFeatureSpec


@hookimpl
def dscore_register_zero_features() -> list[ZeroFeatureSpec]:
    """The ZeRO++ options of stage 3."""
    return [
        ZeroFeatureSpec(
            name="hpz",
            factory="dscore_plugins.zeropp.hpz:build_hierarchical_partitioning",
            config_keys=("zero_hpz_partition_size",),
            description="ZeRO++ hpZ: secondary parameter partitions, re-gathers inside blocks of ranks",
        ),
        ZeroFeatureSpec(
            name="qwz",
            factory="dscore_plugins.zeropp.qwz:build",
            config_keys=("zero_quantized_weights", "zero_quantized_nontrainable_weights"),
            description="ZeRO++ qwZ: training gathers of parameters as int8 blocks with fp32 scales",
        ),
        ZeroFeatureSpec(
            name="qgz",
            factory="dscore_plugins.zeropp.qgz:build",
            config_keys=("zero_quantized_gradients",),
            description="ZeRO++ qgZ: gradient reduce-scatter as int4 all-to-alls, intra- then inter-node",
        ),
    ]
