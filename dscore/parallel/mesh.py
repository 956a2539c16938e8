"""One device mesh for the parallel dimensions of a run: data x sequence x tensor.

Rank layout (tensor fastest, then sequence, then data, as DeepSpeed and Megatron place them so that a
tensor-parallel group is the closest ranks)::

    global_rank = (dp_rank * sp_size + sp_rank) * tp_size + tp_rank

Groups built (every rank creates every group, in the same order, as ``torch.distributed.new_group``
requires): the tensor-parallel groups (same dp and sp index), the sequence-parallel groups (same dp and
tp index), the data-parallel groups (same sp and tp index) and the *gradient* groups (same tp index: the
sequence x data ranks), over which the ZeRO stage reduces gradients and partitions state. Replicated
parameters of a sequence-parallel model see a different part of the sequence on each sp rank, so their
gradients are averaged over sp x dp; tensor-parallel shards differ across tp ranks and are never reduced
over tp.

**Experts (MoE).** Expert parallelism splits the data dimension: with expert-parallel size ``E``
(dividing ``dp``), the expert-parallel (EP) groups are consecutive blocks of ``E`` data-parallel indices and
the expert-data-parallel (EDP) groups the strided sets ``[j, j + E, ...]``, both at a fixed sequence and
tensor index (DeepSpeed's ``_create_expert_and_data_parallel`` layout). :meth:`ParallelMesh.expert_groups`
builds them once per ``E`` (collective) and keeps them with the mesh. Expert parallelism is not combined
with tensor or sequence parallelism (refused: AutoTP would split the experts' linears, and Ulysses gives
the sequence ranks different tokens for one all-to-all).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dscore.errors import ConfigError

__all__ = ["MeshShape", "ParallelMesh", "batch_world_size", "raw_mesh_degrees"]

if TYPE_CHECKING:
    from dscore.moe.groups import ExpertGroups

log = logging.getLogger("dscore.parallel.mesh")


def raw_mesh_degrees(data: dict[str, Any]) -> tuple[int, int]:
    """``(tp, sp)`` read from a raw ds_config dict before validation (for the batch triangle's world size).

    Invalid values count as 1 here; :func:`dscore.config.load_config` then reports them with their key path.
    """
    tp_block = data.get("tensor_parallel")
    tp_raw = tp_block.get("autotp_size", 0) if isinstance(tp_block, dict) else 0
    sp_raw = data.get("sequence_parallel_size", 1)
    tp = tp_raw if isinstance(tp_raw, int) and not isinstance(tp_raw, bool) and tp_raw > 1 else 1
    sp = sp_raw if isinstance(sp_raw, int) and not isinstance(sp_raw, bool) and sp_raw > 1 else 1
    return tp, sp


def batch_world_size(world: int, data: dict[str, Any], *, source: str, mpu: Any = None) -> tuple[int, str]:
    """The world size the batch triangle multiplies by, chosen as DeepSpeed 0.19.8's ``DeepSpeedConfig`` does.

    In order: an ``mpu`` with ``get_data_parallel_world_size()`` gives that; an ``mpu`` with only
    ``get_sequence_parallel_world_size()`` gives ``world / sp``; else a top-level ``sequence_parallel_size``
    gives ``world / sequence_parallel_size``; else ``world``. ``tensor_parallel.autotp_size`` does not
    divide it: as in DeepSpeed, ``train_batch_size`` counts every rank of a tensor-parallel group (which
    all see the same micro batch), so the Hugging Face Trainer's ``world x micro x accumulation`` holds.

    Args:
        world: the number of ranks (> 0).
        data: the raw top-level ds_config dict (read only).
        source: where ``world`` came from, for messages.
        mpu: the ``mpu`` given to ``initialize`` (None when none).

    Returns:
        ``(world size, where it came from)``, the second for the triangle's error messages.

    Raises:
        ConfigError: ``tensor_parallel.autotp_size x sequence_parallel_size`` (or the mpu's degree) does
            not divide ``world``, or the mpu's data-parallel size is not a positive integer.
    """
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        dp = mpu.get_data_parallel_world_size()
        if isinstance(dp, bool) or not isinstance(dp, int) or dp <= 0:
            raise ConfigError(f"mpu.get_data_parallel_world_size() returned {dp!r}; expected a positive integer")
        return dp, f"mpu.get_data_parallel_world_size() = {dp} of {world} ranks ({source})"
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        sp = int(mpu.get_sequence_parallel_world_size())
        shape = MeshShape.of(world, sp=sp, source=source)
        return shape.dp, f"{source} / mpu's sequence-parallel size {sp}"
    tp, sp = raw_mesh_degrees(data)
    MeshShape.of(world, tp=tp, sp=sp, source=source)  # the mesh must fit; refused here, before the network
    if sp > 1:
        return world // sp, f"{source} / sequence_parallel_size {sp}"
    if tp > 1:
        return world, f"{source}; tensor-parallel ranks count, as in DeepSpeed"
    return world, source


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the dimensions: ``world = dp x sp x tp``.

    Raises (from :meth:`of`):
        ConfigError: ``tp x sp`` does not divide the world size (names both keys and the world).
    """

    world: int
    tp: int = 1
    sp: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel size ``world / (tp x sp)``."""
        return self.world // (self.tp * self.sp)

    @classmethod
    def of(cls, world: int, *, tp: int = 1, sp: int = 1, source: str = "") -> MeshShape:
        """Check and build the shape of ``world`` ranks with ``tp`` tensor- and ``sp`` sequence-parallel ranks."""
        tp, sp = max(1, int(tp)), max(1, int(sp))
        if world % (tp * sp) != 0:
            where = f" ({source})" if source else ""
            raise ConfigError(
                f"tensor_parallel.autotp_size ({tp}) x sequence_parallel_size ({sp}) = {tp * sp} does not divide the "
                f"world size {world}{where}; launch a multiple of {tp * sp} processes or lower the degrees",
                path="tensor_parallel.autotp_size" if tp > 1 else "sequence_parallel_size",
            )
        return cls(world=world, tp=tp, sp=sp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, sp_rank, tp_rank)`` of global ``rank``."""
        return rank // (self.sp * self.tp), (rank // self.tp) % self.sp, rank % self.tp

    def rank_of(self, dp: int, sp: int, tp: int) -> int:
        """The global rank at mesh coordinates ``(dp, sp, tp)``."""
        return (dp * self.sp + sp) * self.tp + tp

    def tp_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s tensor-parallel group."""
        d, s, _ = self.coords(rank)
        return [self.rank_of(d, s, t) for t in range(self.tp)]

    def sp_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s sequence-parallel group."""
        d, _, t = self.coords(rank)
        return [self.rank_of(d, s, t) for s in range(self.sp)]

    def dp_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s data-parallel group."""
        _, s, t = self.coords(rank)
        return [self.rank_of(d, s, t) for d in range(self.dp)]

    def ep_ranks(self, rank: int, ep_size: int) -> list[int]:
        """Global ranks of ``rank``'s expert-parallel group: ``ep_size`` consecutive data-parallel indices.

        Raises:
            ConfigError: ``ep_size`` does not divide the data-parallel size.
        """
        from dscore.moe.groups import ExpertTopology

        d, s, t = self.coords(rank)
        topo = ExpertTopology(self.dp, int(ep_size))
        return [self.rank_of(q, s, t) for q in topo.ep_groups[d // topo.ep_size]]

    def edp_ranks(self, rank: int, ep_size: int) -> list[int]:
        """Global ranks of ``rank``'s expert-data-parallel group (the ranks holding the same experts).

        Raises:
            ConfigError: ``ep_size`` does not divide the data-parallel size.
        """
        from dscore.moe.groups import ExpertTopology

        d, s, t = self.coords(rank)
        topo = ExpertTopology(self.dp, int(ep_size))
        return [self.rank_of(q, s, t) for q in topo.edp_groups[topo.ep_rank(d)]]

    def grad_ranks(self, rank: int) -> list[int]:
        """Global ranks gradients of ``rank`` are reduced over: its sequence x data ranks (same tp index)."""
        _, _, t = self.coords(rank)
        return [self.rank_of(d, s, t) for d in range(self.dp) for s in range(self.sp)]

    def zero_param_ranks(self, rank: int, hpz: int) -> list[int]:
        """Global ranks of ``rank``'s ZeRO++ hpZ group: the gradient group cut into contiguous blocks of
        ``hpz`` ranks (DeepSpeed's ``_create_zero_param_parallel_group``; without model parallelism the
        world's ranks ``{0..hpz-1}, {hpz..2hpz-1}, ...``, the closest ranks, so that a block is one node).

        Raises:
            ConfigError: ``hpz`` does not divide the gradient group's size (names the key and the valid sizes).
        """
        grad = self.grad_ranks(rank)
        n = len(grad)
        if hpz < 1 or n % hpz != 0:
            valid = [d for d in range(1, n + 1) if n % d == 0]
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size {hpz} must divide the size of the group ZeRO "
                f"partitions over, {n} ranks (world {self.world} / tensor-parallel {self.tp}); valid sizes here: "
                f"{valid}",
                path="zero_optimization.zero_hpz_partition_size",
            )
        i = grad.index(rank) // hpz
        return grad[i * hpz : (i + 1) * hpz]


@dataclass
class ParallelMesh:
    """The groups of one run's mesh, and a :class:`dscore.comm.Comm` bound to each.

    Build it with :meth:`create` (collective: every rank of ``comm`` calls it). A dimension spanning the
    whole world reuses ``comm`` itself; a tensor or sequence dimension of size 1 has no comm (None) and no
    process group (the data and gradient dimensions always have one: the ZeRO stage reduces over it).

    Attributes:
        shape: the :class:`MeshShape`.
        rank: this process's global rank; ``dp_rank`` / ``sp_rank`` / ``tp_rank`` its coordinates.
        tp_comm / sp_comm / dp_comm / grad_comm: facades bound to this rank's groups.
        zero_param_intra_comm: the ZeRO++ hpZ group's facade once stage 3 built it, else None.
    """

    shape: MeshShape
    rank: int
    tp_comm: Any
    sp_comm: Any
    dp_comm: Any
    grad_comm: Any
    _owned: list[Any] = field(default_factory=list, repr=False)
    _zero_param: dict[int, Any] = field(default_factory=dict, repr=False)
    #: the Comm of this rank's ZeRO++ hpZ group once a stage built it (:meth:`zero_param_comm`), else None
    zero_param_intra_comm: Any = field(default=None, repr=False)
    _base: Any = field(default=None, repr=False)
    _experts: dict[int, ExpertGroups] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, comm: Any, *, tp: int = 1, sp: int = 1) -> ParallelMesh:
        """Build the mesh of ``comm``'s world with ``tp`` x ``sp`` model-parallel ranks (collective).

        Raises:
            ConfigError: ``tp x sp`` does not divide the world size.
        """
        world, rank = int(comm.get_world_size()), int(comm.get_rank())
        shape = MeshShape.of(world, tp=tp, sp=sp)
        comms: dict[str, Any] = {}
        owned: list[Any] = []
        kinds = (("tp", shape.tp_ranks), ("sp", shape.sp_ranks), ("dp", shape.dp_ranks), ("grad", shape.grad_ranks))
        for name, ranks_of in kinds:
            mine = ranks_of(rank)
            if len(mine) == world:
                comms[name] = comm
                continue
            if len(mine) == 1 and name in ("tp", "sp"):
                comms[name] = None  # an unused model-parallel dimension needs no group (none per rank)
                continue
            # every rank creates every group of this kind, in global order (torch's new_group rule)
            seen: list[list[int]] = []
            for r in range(world):
                ranks = ranks_of(r)
                if ranks in seen:
                    continue
                seen.append(ranks)
                group = comm.new_group(ranks)
                owned.append(group)
                if rank in ranks:
                    comms[name] = comm.bound_to(group)
        mesh = cls(shape, rank, comms["tp"], comms["sp"], comms["dp"], comms["grad"], owned, _base=comm)
        log.info(
            "mesh: world %d = dp %d x sp %d x tp %d; rank %d at %s",
            world,
            shape.dp,
            shape.sp,
            shape.tp,
            rank,
            shape.coords(rank),
        )
        return mesh

    def zero_param_comm(self, hpz: int) -> Any:
        """The :class:`dscore.comm.Comm` of this rank's ZeRO++ hpZ group (:meth:`MeshShape.zero_param_ranks`),
        built on first use (collective: every rank of the mesh calls it with the same ``hpz``; then cached).

        A group of the whole gradient group is ``grad_comm`` itself; ``hpz`` 1 has no group (None).

        Raises:
            ConfigError: ``hpz`` does not divide the gradient group's size.
        """
        if hpz in self._zero_param:
            return self._zero_param[hpz]
        mine = self.shape.zero_param_ranks(self.rank, hpz)
        if hpz == 1:
            comm = None
        elif len(mine) == len(self.shape.grad_ranks(self.rank)):
            comm = self.grad_comm
        else:
            comm = None
            seen: list[list[int]] = []
            for r in range(self.shape.world):  # every rank creates every group, in global order
                ranks = self.shape.zero_param_ranks(r, hpz)
                if ranks in seen:
                    continue
                seen.append(ranks)
                group = self.grad_comm.new_group(ranks)
                self._owned.append(group)
                if self.rank in ranks:
                    comm = self.grad_comm.bound_to(group)
        self._zero_param[hpz] = comm
        self.zero_param_intra_comm = comm
        log.info("mesh: ZeRO++ hpZ groups of %d rank(s); rank %d in %s", hpz, self.rank, mine)
        return comm
    def expert_groups(self, ep_size: int) -> ExpertGroups:
        """The expert-parallel and expert-data-parallel groups of ``ep_size`` (see the module docstring),
        created on first use (collective: every rank calls it with the same ``ep_size`` in the same
        order) and kept with the mesh. A group spanning the whole world reuses the mesh's comm.

        Raises:
            ConfigError: tensor or sequence parallelism is on (expert parallelism does not combine with
                them; names the key), or ``ep_size`` does not divide the data-parallel size.
        """
        from dscore.moe.groups import ExpertGroups, ExpertTopology

        ep_size = int(ep_size)
        cached = self._experts.get(ep_size)
        if cached is not None:
            return cached
        if self.shape.tp > 1 or self.shape.sp > 1:
            key = "tensor_parallel.autotp_size" if self.shape.tp > 1 else "sequence_parallel_size"
            size = self.shape.tp if self.shape.tp > 1 else self.shape.sp
            raise ConfigError(
                f"MoE expert parallelism (dscore.moe.layer.MoE) with {key} = {size} is not implemented: "
                "tensor parallelism would split the experts' linears and sequence parallelism gives the sequence "
                f"ranks different tokens for one expert all-to-all; set {key} to 1 for MoE models",
                path=key,
            )
        world = self.shape.world
        topo = ExpertTopology(self.dp_size, ep_size)  # raises when ep_size does not divide dp
        found: dict[str, Any] = {}
        for kind, ranks_of in (("ep", self.shape.ep_ranks), ("edp", self.shape.edp_ranks)):
            mine = ranks_of(self.rank, ep_size)
            if len(mine) == world:
                found[kind] = self._base
                continue
            seen: list[list[int]] = []
            for r in range(world):  # every rank creates every group, in global order
                ranks = ranks_of(r, ep_size)
                if ranks in seen:
                    continue
                seen.append(ranks)
                group = self._base.new_group(ranks)
                self._owned.append(group)
                if self.rank in ranks:
                    found[kind] = self._base.bound_to(group)
        d = self.dp_rank
        groups = ExpertGroups(topo, found["ep"], found["edp"], topo.ep_rank(d), topo.edp_rank(d))
        self._experts[ep_size] = groups
        log.info("mesh: expert groups ep_size %d: ep %s, edp %s", ep_size,
                 self.shape.ep_ranks(self.rank, ep_size), self.shape.edp_ranks(self.rank, ep_size))  # fmt: skip
        return groups

    def created_expert_groups(self, group_name: str) -> ExpertGroups:
        """The expert groups named ``group_name`` (``"ep_size_<E>"``, DeepSpeed's name) if
        :meth:`expert_groups` built them; never collective.

        Raises:
            DscoreError: no such groups were built (names the sizes that were).
        """
        from dscore.errors import DscoreError

        head, _, size = str(group_name).rpartition("_")
        groups = self._experts.get(int(size)) if head == "ep_size" and size.isdigit() else None
        if groups is None:
            built = [f"ep_size_{e}" for e in sorted(self._experts)] or "none"
            raise DscoreError(
                f"no expert-parallel groups named {group_name!r} on this mesh (built: {built}); an MoE layer with "
                "ep_size E gets the groups 'ep_size_<E>' at dscore.initialize"
            )
        return groups

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree."""
        return self.shape.tp

    @property
    def sp_size(self) -> int:
        """Sequence-parallel degree."""
        return self.shape.sp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree ``world / (tp x sp)``."""
        return self.shape.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index along the data dimension."""
        return self.shape.coords(self.rank)[0]

    @property
    def sp_rank(self) -> int:
        """This rank's index inside its sequence-parallel group."""
        return self.shape.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its tensor-parallel group."""
        return self.shape.coords(self.rank)[2]

    # DeepSpeed's mpu interface (``deepspeed.initialize(mpu=...)`` and ``deepspeed.utils.groups``)
    @staticmethod
    def _group_of(comm: Any, what: str, key: str) -> Any:
        # never None: None means "the default group" to torch.distributed, which a one-rank dimension is not
        if comm is None:
            from dscore.errors import DscoreError

            raise DscoreError(f"{key} is 1: there is no {what} process group (check the world size accessor first)")
        if comm.group is None:
            import torch.distributed as dist

            return dist.group.WORLD
        return comm.group

    def get_tensor_model_parallel_group(self) -> Any:
        """The tensor-parallel process group (``torch.distributed`` group; ``group.WORLD`` when it spans the job).

        Raises:
            DscoreError: the tensor-parallel degree is 1 (no group exists).
        """
        return self._group_of(self.tp_comm, "tensor-parallel", "tensor_parallel.autotp_size")

    def get_tensor_model_parallel_world_size(self) -> int:
        """Tensor-parallel degree."""
        return self.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        """Rank inside the tensor-parallel group."""
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        """Tensor-parallel degree (DeepSpeed's model-parallel size)."""
        return self.tp_size

    def get_model_parallel_rank(self) -> int:
        """Rank inside the tensor-parallel group."""
        return self.tp_rank

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel process group (``group.WORLD`` when it spans the job).

        Raises:
            DscoreError: the sequence-parallel degree is 1 (no group exists).
        """
        return self._group_of(self.sp_comm, "sequence-parallel", "sequence_parallel_size")

    def get_sequence_parallel_world_size(self) -> int:
        """Sequence-parallel degree."""
        return self.sp_size

    def get_sequence_parallel_rank(self) -> int:
        """Rank inside the sequence-parallel group."""
        return self.sp_rank

    def get_data_parallel_group(self) -> Any:
        """The data-parallel process group (``group.WORLD`` when it spans the job)."""
        return self._group_of(self.dp_comm, "data-parallel", "the data-parallel size")

    def get_data_parallel_world_size(self) -> int:
        """Data-parallel degree."""
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        """Rank along the data dimension."""
        return self.dp_rank

    def get_sequence_data_parallel_group(self) -> Any:
        """The group gradients are reduced over (sequence x data ranks; ``group.WORLD`` when it spans the job)."""
        return self._group_of(self.grad_comm, "sequence x data", "the sequence x data size")

    def get_sequence_data_parallel_world_size(self) -> int:
        """``sp x dp``."""
        return self.sp_size * self.dp_size

    def get_sequence_data_parallel_rank(self) -> int:
        """Rank inside the sequence x data group."""
        return self.dp_rank * self.sp_size + self.sp_rank

    def matches(self, *, tp: int, sp: int, world: int) -> bool:
        """Whether this mesh has these sizes."""
        return (self.shape.tp, self.shape.sp, self.shape.world) == (max(1, tp), max(1, sp), world)
