"""Pipe x data process topology and the process groups it implies (DeepSpeed's ``ProcessTopology``,
``PipeDataParallelTopology`` and ``PipelineParallelGrid``).

Ranks are laid out on a Cartesian grid whose *last* axis varies fastest: with axes ``("pipe", "data")``
and ``num_dp`` data-parallel replicas, global rank ``r`` sits at stage ``r // num_dp`` and data-parallel
index ``r % num_dp`` (DeepSpeed's order, so neighbouring ranks replicate one stage). The groups:

* **data-parallel group** of a stage: the ``num_dp`` ranks holding that stage (gradients are averaged and
  ZeRO partitions over it);
* **pipe group** of a replica: the ``num_stages`` ranks with one data-parallel index (activations and
  gradients flow along it; partial squared gradient norms are summed over it for global-norm clipping);
* **tied groups**: for every ``TiedLayerSpec`` key, per data-parallel index, the ranks of the stages
  owning the tied module (their gradients are summed over it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dscore.errors import ConfigError, DistributedError

__all__ = ["PipeDataParallelTopology", "PipelineGrid", "ProcessTopology"]


class ProcessTopology:
    """A Cartesian mapping of global ranks to named axes.

    Args:
        axes: axis names, outermost first (``["pipe", "data"]``).
        dims: size of each axis (all >= 1).

    Raises:
        ConfigError: lengths differ, a size is below 1, or names repeat.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ConfigError(f"topology axes {list(axes)} and dims {list(dims)} must pair up one to one, names unique")
        if any(int(d) < 1 for d in dims):
            raise ConfigError(f"topology dims must all be >= 1, got {list(dims)}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self._coords = list(itertools.product(*(range(d) for d in self.dims)))

    def world_size(self) -> int:
        """Number of ranks (the product of the dims)."""
        return len(self._coords)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis``."""
        return self.dims[self.axes.index(axis)]

    def get_coord(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of global ``rank``."""
        return dict(zip(self.axes, self._coords[rank]))

    def get_rank(self, **coords: int) -> int:
        """The global rank at ``coords`` (every axis given).

        Raises:
            ConfigError: an axis is missing or unknown.
        """
        if set(coords) != set(self.axes):
            raise ConfigError(f"get_rank needs exactly the axes {self.axes}, got {sorted(coords)}")
        key = tuple(int(coords[a]) for a in self.axes)
        return self._coords.index(key)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Global ranks whose coordinate on ``axis`` is ``idx``."""
        i = self.axes.index(axis)
        return [r for r, c in enumerate(self._coords) if c[i] == idx]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Groups of ranks that differ only along ``axis`` (one list per combination of the other axes)."""
        i = self.axes.index(axis)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, c in enumerate(self._coords):
            groups.setdefault(c[:i] + c[i + 1 :], []).append(r)
        return list(groups.values())


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``("pipe", "data")``: ``num_pp`` stages times ``num_dp`` data-parallel replicas."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


@dataclass
class PipelineGrid:
    """This rank's place in a pipe x data topology and the ``torch.distributed`` groups it needs.

    Built by :class:`dscore.pipe.PipelineModule`; collective at construction (every rank of the default
    group creates every group, in the same order). Without a process group (one process) all groups are
    None and the sizes are 1.

    Attributes:
        topology: the :class:`ProcessTopology`.
        global_rank: this process's rank; ``stage_id`` / ``data_parallel_id`` its coordinates.
        num_stages / data_parallel_size: the axis sizes.
        dp_group / pipe_group: this rank's data-parallel and pipe groups (None with one process).
        pipe_ranks: global ranks of this replica's stages, stage order (``pipe_ranks[s]`` holds stage s).
        dp_ranks: global ranks of this stage's replicas.
        tied_groups: tie key -> (group over this replica's owner stages, their global ranks) for keys
            this stage owns; a key owned by one stage only maps to ``(None, [rank])``.
    """

    topology: ProcessTopology
    global_rank: int
    stage_id: int
    data_parallel_id: int
    num_stages: int
    data_parallel_size: int
    dp_group: Any
    pipe_group: Any
    pipe_ranks: list[int]
    dp_ranks: list[int]
    tied_groups: dict[str, tuple[Any, list[int]]]

    @classmethod
    def create(cls, topology: ProcessTopology, tie_owners: dict[str, list[int]]) -> PipelineGrid:
        """Create the groups of ``topology`` for this process.

        Args:
            topology: a topology with ``pipe`` and ``data`` axes (and no other axis of size > 1).
            tie_owners: tie key -> sorted stage ids owning the tied module.

        Raises:
            DistributedError: the process group's world size differs from the topology's.
        """
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        if world != topology.world_size():
            raise DistributedError(
                f"the pipeline topology {dict(zip(topology.axes, topology.dims))} needs {topology.world_size()} "
                f"processes but the process group has {world}; launch num_stages x data_parallel_size processes"
            )
        coord = topology.get_coord(rank)
        stage, dp_id = coord["pipe"], coord["data"]
        num_stages, num_dp = topology.get_dim("pipe"), topology.get_dim("data")
        dp_group = pipe_group = None
        dp_ranks = topology.get_axis_list("pipe", stage)
        pipe_ranks = topology.get_axis_list("data", dp_id)
        tied: dict[str, tuple[Any, list[int]]] = {}
        if initialized and world > 1:
            # every rank creates every group in the same order (torch.distributed.new_group is collective)
            for ranks in topology.get_axis_comm_lists("data"):
                g = dist.new_group(ranks=ranks)
                if rank in ranks:
                    dp_group = g
            for ranks in topology.get_axis_comm_lists("pipe"):
                g = dist.new_group(ranks=ranks)
                if rank in ranks:
                    pipe_group = g
            for key in sorted(tie_owners):
                owners = tie_owners[key]
                for d in range(num_dp):
                    ranks = [topology.get_rank(pipe=s, data=d) for s in owners]
                    g = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
                    if rank in ranks:
                        tied[key] = (g, ranks)
        else:
            for key, owners in tie_owners.items():
                if stage in owners:
                    tied[key] = (None, [rank])
        return cls(
            topology=topology,
            global_rank=rank,
            stage_id=stage,
            data_parallel_id=dp_id,
            num_stages=num_stages,
            data_parallel_size=num_dp,
            dp_group=dp_group,
            pipe_group=pipe_group,
            pipe_ranks=pipe_ranks,
            dp_ranks=dp_ranks,
            tied_groups=tied,
        )

    # DeepSpeed's grid accessors (``model.mpu()`` returns the grid)
    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.num_stages

    def get_data_parallel_world_size(self) -> int:
        """Number of data-parallel replicas of each stage."""
        return self.data_parallel_size

    def get_data_parallel_rank(self) -> int:
        """This rank's index among its stage's replicas."""
        return self.data_parallel_id

    def get_data_parallel_group(self) -> Any:
        """This stage's data-parallel group (None with one process)."""
        return self.dp_group

    def get_model_parallel_world_size(self) -> int:
        """No tensor parallelism: 1."""
        return 1

    def stage_to_global(self, stage_id: int) -> int:
        """Global rank of ``stage_id`` in this rank's replica."""
        return self.pipe_ranks[stage_id]
