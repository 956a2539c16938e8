"""ZeRO stage 1: optimizer state (and fp32 master weights) partitioned; see :mod:`.partitioned`."""

from __future__ import annotations

from dscore_plugins.zero.partitioned import PartitionedOptimizerStage

__all__ = ["Stage1"]


class Stage1(PartitionedOptimizerStage):
    """Each rank keeps optimizer state and master weights for ``1/world`` of the parameters; full
    gradients are accumulated locally and reduce-scattered in buckets at the boundary."""

    stage = 1
    partition_gradients = False
