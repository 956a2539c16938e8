"""ZeRO stage 2: optimizer state and gradients partitioned; see :mod:`.partitioned`."""

from __future__ import annotations

from dscore_plugins.zero.partitioned import PartitionedOptimizerStage

__all__ = ["Stage2"]


class Stage2(PartitionedOptimizerStage):
    """Stage 1 plus gradient partitioning: gradients are reduce-scattered in buckets during every
    backward (overlapped with ``overlap_comm``) and only this rank's fp32 gradient chunk is kept."""

    stage = 2
    partition_gradients = True
