"""Expert-parallel (EP) and expert-data-parallel (EDP) process groups.

DeepSpeed 0.19.8's layout (``deepspeed/utils/groups.py::_create_expert_and_data_parallel``, without
tensor parallelism): with ``W`` ranks and expert-parallel size ``E`` (``W % E == 0``), the EP groups are
consecutive blocks ``[k·E, …, k·E + E − 1]`` (each holds every expert once, ``num_experts / E`` per rank)
and the EDP groups are the strided sets ``[j, j + E, j + 2E, …]`` (the ranks holding the same experts,
over which expert gradients are reduced).

:class:`ExpertTopology` is the pure rank arithmetic (no process groups). Under ``dscore.initialize`` the
groups are groups of the run's device mesh (:meth:`dscore.parallel.mesh.ParallelMesh.expert_groups`:
the expert dimension splits the data dimension, kept with the mesh, so two engines keep their own);
:func:`expert_groups` asks the mesh for them. Without a mesh (an MoE layer wired by hand over a comm) it
creates them once per ``(world group, E)`` through the :class:`dscore.comm.Comm` facade (collective:
every rank calls it in the same order) and caches them. DeepSpeed names the groups ``ep_size_<E>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dscore.errors import ConfigError

__all__ = ["ExpertGroups", "ExpertTopology", "expert_groups", "group_name"]


def group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of size ``ep_size``: ``"ep_size_<ep_size>"``."""
    return f"ep_size_{int(ep_size)}"


@dataclass(frozen=True)
class ExpertTopology:
    """Rank lists of the EP and EDP groups for ``world_size`` ranks and ``ep_size`` (pure arithmetic).

    Raises:
        ConfigError: ``ep_size`` < 1 or does not divide ``world_size``.
    """

    world_size: int
    ep_size: int

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise ConfigError(
                f"MoE ep_size={self.ep_size} must be >= 1 and divide the data-parallel world size "
                f"({self.world_size}); valid: {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
            )

    @property
    def ep_groups(self) -> list[list[int]]:
        """``[[0..E-1], [E..2E-1], ...]``."""
        e = self.ep_size
        return [list(range(k * e, (k + 1) * e)) for k in range(self.world_size // e)]

    @property
    def edp_groups(self) -> list[list[int]]:
        """``[[0, E, 2E, ...], [1, E+1, ...], ...]``."""
        return [list(range(j, self.world_size, self.ep_size)) for j in range(self.ep_size)]

    def ep_rank(self, rank: int) -> int:
        """Position of global ``rank`` in its EP group (which experts it holds)."""
        return rank % self.ep_size

    def edp_rank(self, rank: int) -> int:
        """Position of global ``rank`` in its EDP group."""
        return rank // self.ep_size


@dataclass
class ExpertGroups:
    """The process groups of one expert-parallel size for this rank.

    Attributes:
        topology: the rank lists.
        ep_comm: a :class:`dscore.comm.Comm` bound to this rank's EP group (dispatch / combine).
        edp_comm: bound to this rank's EDP group (expert gradient reduction).
        ep_rank / edp_rank: this rank's position in each.
    """

    topology: ExpertTopology
    ep_comm: Any
    edp_comm: Any
    ep_rank: int
    edp_rank: int

    @property
    def name(self) -> str:
        """``ep_size_<E>``."""
        return group_name(self.topology.ep_size)


_GROUPS: dict[tuple[int, int], ExpertGroups] = {}


def expert_groups(comm: Any, ep_size: int, *, mesh: Any = None) -> ExpertGroups:
    """The EP/EDP groups of ``ep_size`` over ``comm``'s group, created on first use (collective).

    Args:
        comm: the data-parallel :class:`dscore.comm.Comm` (its group's ranks are numbered 0..W-1; the
            groups are built over the global ranks of that group).
        ep_size: the expert-parallel size.
        mesh: the run's :class:`dscore.parallel.mesh.ParallelMesh` (``engine.runtime.mesh``): the groups
            are the mesh's (``comm`` must then be the mesh's data-parallel or gradient comm).

    Raises:
        ConfigError: ``ep_size`` does not divide the (data-parallel) world size; with ``mesh``, tensor or
            sequence parallelism is on (not combined with expert parallelism).
    """
    if mesh is not None:
        return mesh.expert_groups(ep_size)  # type: ignore[no-any-return]
    world, rank = int(comm.get_world_size()), int(comm.get_rank())
    key = (id(comm.group), int(ep_size))
    cached = _GROUPS.get(key)
    if cached is not None and cached.topology.world_size == world:
        return cached
    topo = ExpertTopology(world, int(ep_size))
    if world == 1:
        groups = ExpertGroups(topo, comm, comm, 0, 0)
    else:
        ep_comm = edp_comm = None
        # every rank creates every group, in the same order (torch.distributed.new_group's rule)
        for ranks in topo.ep_groups:
            grp = comm.new_group([comm.global_rank(r) for r in ranks])
            if rank in ranks:
                ep_comm = comm.bound_to(grp)
        for ranks in topo.edp_groups:
            grp = comm.new_group([comm.global_rank(r) for r in ranks])
            if rank in ranks:
                edp_comm = comm.bound_to(grp)
        groups = ExpertGroups(topo, ep_comm, edp_comm, topo.ep_rank(rank), topo.edp_rank(rank))
    _GROUPS[key] = groups
    return groups
