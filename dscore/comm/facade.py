"""The collective facade: :class:`Comm`, a thin layer over ``torch.distributed`` bound to a process group.

A ``Comm`` is created by :func:`dscore.init_distributed` and owned by the runtime
(:class:`dscore.runtime.runtime.Runtime`); it is not a module global. Every collective takes the same
tensors and returns the same work handles as ``torch.distributed``, with three conveniences:

* ``op`` is a string (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``) or a ``ReduceOp``;
* ``group=None`` means the group this facade is bound to (the default group after ``init_distributed``);
* operations a backend lacks are emulated exactly (:mod:`~dscore.comm.transports.native`: an average as a
  sum and a division, a reduce-scatter as an all-reduce and a slice copy), decided once per operation and
  facade; ``emulate=`` forces the emulation (tests use it to check both paths).

Every collective in dscore goes through this class (ZeRO stages, ``dscore.zero.Init``, checkpoints). Each
one checks its arguments, shortcuts a one-rank group, picks a transport and runs the collective on it:

* **Transports** (:mod:`dscore.comm.transports`): the backend's own collective
  (:mod:`~dscore.comm.transports.native`, :attr:`Comm.native`; the fallback, and always for a non-CPU
  tensor) or one of the registered ``comm_transport`` units, asked in descending priority
  (:attr:`Comm.transports`, from this facade's registry: the runtime's, so ``plugins.disable`` holds).
  The comm plugin registers gloo point-to-point (``p2p``: on gloo, all-gathers and sum/average
  reduce-scatters as pairwise exchanges, a ring's volume per rank) and same-host shared memory
  (``shm``: the same exchanges and sum/average all-reduces, when every rank of the group is on this
  host; ``DSCORE_SHM=0`` or ``comm_transport:shm`` disabled turns it off). Every transport launches all of a
  collective's transfers in the launching call, numbered in launch order, so ``wait()`` only completes
  and any wait order (or a work never waited) gives torch's results. Other reduce ops use an all-reduce
  and a slice copy. ``DSCORE_GLOO_NATIVE=1`` turns the pairwise transports off (gloo's own calls are
  used). Pass ``input_reusable=True`` to :meth:`Comm.reduce_scatter_tensor` when the input may be
  overwritten: the all-reduce fallback then runs in place instead of on a copy, and ``output`` may alias
  this rank's chunk.
* **Async work handles.** With ``async_op=True`` every collective returns a :class:`Work`: ``wait()`` is
  idempotent and also runs the operation's finishing step (an emulation's division or slice copy), so
  a caller never needs to know which path ran. ``async_op=False`` returns ``None`` (torch's contract).
* **One rank.** A group of one rank (or no process group at all: rank 0 of 1, e.g. ``dscore.zero.Init``
  before ``init_distributed``) runs no collective: gathers and reduce-scatters are local copies.
* **Agreeing on errors.** :meth:`Comm.agree` all-gathers each rank's outcome of a phase (None or an
  exception) so a failure on one rank raises the same error on every rank instead of hanging the others
  in the next collective (checkpoint save/load ends each phase with it).

Ranks passed to :meth:`Comm.broadcast` (``src``) are global ranks, as in torch.distributed;
:meth:`Comm.global_rank` converts a rank of the bound group.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from dscore.comm import objects
from dscore.comm.instrument import instrumentable
from dscore.comm.transports import Transport, current_registry, default_registry, pick, registered_transports
from dscore.comm.transports.native import NativeTransport, result
from dscore.comm.work import DONE, Work, launched
from dscore.errors import DistributedError, DscoreError

if TYPE_CHECKING:
    from dscore.comm.env import DistributedEnv
    from dscore.registry import Registry

__all__ = ["Comm", "EMULABLE_OPS", "RankFailure", "Work", "reduce_op"]

#: operations the facade can emulate when the backend lacks them.
EMULABLE_OPS = frozenset({"avg", "reduce_scatter_tensor", "reduce_scatter"})

_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "mean": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}

def reduce_op(op: str | Any) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op``.

    ``op`` is a name (case-insensitive: ``sum``, ``avg``/``mean``, ``max``, ``min``, ``product``/``prod``,
    ``band``, ``bor``, ``bxor``), a ``torch.distributed.ReduceOp`` (returned as it is), or an
    :class:`enum.Enum` member named like one (``SUM``, ``AVG``, ...: DeepSpeed's ``deepspeed.comm.ReduceOp``).

    Raises:
        DistributedError: unknown name or enum member (``UNUSED``), or another type; the message lists the
            valid names.
    """
    if isinstance(op, dist.ReduceOp) or isinstance(op, getattr(dist.ReduceOp, "RedOpType", ())):
        return op
    name = op.name if isinstance(op, enum.Enum) else op
    if isinstance(name, str):
        try:
            return _OPS[name.lower()]
        except KeyError:
            pass
    raise DistributedError(f"unknown reduce op {op!r}; valid: {', '.join(sorted(_OPS))} (or a ReduceOp)")


def _require_contiguous(output: torch.Tensor, what: str) -> None:
    if not output.is_contiguous():
        raise DistributedError(f"{what}: the output tensor must be contiguous (call .contiguous() on a buffer first)")


def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG


def _pairwise_op(op: Any) -> bool:
    """Ops the pairwise reduce-scatter computes (a sum of received chunks, optionally averaged)."""
    return op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG


_DONE = DONE


class RankFailure:
    """A picklable description of one rank's failure in a phase (see :meth:`Comm.agree`).

    Attributes:
        type_name: the exception's class name.
        own: True for a dscore error (its message is shown as it is).
        message: the error text (prefixed with the class name for foreign exceptions).
    """

    def __init__(self, exc: BaseException) -> None:
        self.type_name = type(exc).__name__
        self.own = isinstance(exc, DscoreError)
        self.message = str(exc) if self.own else f"{type(exc).__name__}: {exc}"


class Comm:
    """Collectives over one process group (see the module docstring for the fallback rules).

    Args:
        group: the process group collectives run on when ``group=None`` is passed (``None``: the default
            group).
        backend: the comm-backend plugin name (``"gloo"``) — informational.
        env: where this process sits (local rank, rendezvous); ``None`` reads ``LOCAL_RANK`` lazily.
        emulate: operations (of :data:`EMULABLE_OPS`) to emulate even if the backend has them.
        owns_group: True when the call that built this facade created the default group (so dscore
            owns it and may destroy it; see :mod:`dscore.comm.init`).
        registry: where the registered transports come from (``comm_transport`` units); None: the
            current runtime's when one is current at construction, else one over the installed plugins.

    Attributes:
        native: this facade's :class:`~dscore.comm.transports.native.NativeTransport` (the backend's own
            collectives and the emulations it switched to).
        registry: the registry given, or the runtime's current at construction (None: resolved at the
            first collective that may leave the backend).
        accelerator: the accelerator whose current device :meth:`all_gather_object` and
            :meth:`broadcast_object` use on a device backend (set by ``init_distributed``, kept by
            :meth:`bound_to`; None: torch's current accelerator).

    Raises:
        DistributedError: ``emulate`` names an operation that cannot be emulated.
    """

    #: the accelerator whose current device object collectives use on a group that takes no host tensors
    #: (:func:`dscore.comm.objects.object_device`); ``init_distributed`` sets it, None: torch's current one
    accelerator: Any = None

    #: the process's owner of the default group dscore created (:data:`dscore.comm.init.PROCESS_GROUP_OWNER`,
    #: which installs itself here): :meth:`destroy` asks it
    group_owner: ClassVar[Any] = None

    def __init__(
        self,
        group: Any = None,
        *,
        backend: str = "",
        env: DistributedEnv | None = None,
        emulate: Iterable[str] = (),
        owns_group: bool = False,
        registry: Registry | None = None,
    ) -> None:
        forced = {name.lower() for name in emulate}
        unknown = forced - EMULABLE_OPS
        if unknown:
            raise DistributedError(f"cannot emulate {sorted(unknown)}; emulable operations: {sorted(EMULABLE_OPS)}")
        self.group = group
        self.backend = backend
        self.env = env
        self.native = NativeTransport(backend, forced)  # the backend's own collectives and their emulations
        self.owns_group = bool(owns_group)
        self.registry = registry if registry is not None else current_registry()
        self._transports: tuple[Transport, ...] | None = None
        self._gloo_fast: dict[int, bool] = {}

    def __repr__(self) -> str:
        if not self.is_initialized():
            return f"Comm(backend={self.backend!r}, no process group)"
        return f"Comm(backend={self.backend!r}, rank={self.get_rank()}, world_size={self.get_world_size()})"

    # ---------------------------------------------------------------- identity
    def _group(self, group: Any) -> Any:
        return self.group if group is None else group

    @staticmethod
    def is_initialized() -> bool:
        """True when torch.distributed has a default process group."""
        return dist.is_available() and dist.is_initialized()

    def get_rank(self, group: Any = None) -> int:
        """This process's rank in ``group`` (the bound group by default); 0 without a process group."""
        if not self.is_initialized():
            return 0
        return int(dist.get_rank(self._group(group)))

    def get_world_size(self, group: Any = None) -> int:
        """Number of ranks in ``group`` (the bound group by default); 1 without a process group."""
        if not self.is_initialized():
            return 1
        return int(dist.get_world_size(self._group(group)))

    @property
    def rank(self) -> int:
        """This process's rank in the bound group (0 without a process group)."""
        return self.get_rank()

    @property
    def world_size(self) -> int:
        """Size of the bound group (1 without a process group)."""
        return self.get_world_size()

    def global_rank(self, group_rank: int) -> int:
        """The global rank of rank ``group_rank`` of the bound group (what :meth:`broadcast` takes)."""
        if self.group is None or not self.is_initialized():
            return int(group_rank)
        return int(dist.get_global_rank(self.group, int(group_rank)))

    def get_local_rank(self) -> int:
        """Rank of this process among those of its node (``LOCAL_RANK``)."""
        if self.env is not None:
            return self.env.local_rank
        return int(os.environ.get("LOCAL_RANK", "0"))

    def get_backend(self, group: Any = None) -> str:
        """The torch backend string of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
        return str(dist.get_backend(self._group(group)))

    def gloo_fast(self, group: Any = None, *tensors: torch.Tensor) -> bool:
        """True when the gloo fast paths apply to ``group`` (gloo backend, ``DSCORE_GLOO_NATIVE`` unset) and
        to every one of ``tensors``: only CPU tensors take them. A device tensor (CUDA, or any non-CPU
        device) never goes through gloo point-to-point (torch has none on GPUs) or host shared memory; it
        takes the backend's own collective.

        The group part is decided once per group (``DSCORE_GLOO_NATIVE`` is read then), so the per-bucket
        cost is a lookup.
        """
        if any(t.device.type != "cpu" for t in tensors):
            return False
        grp = self._group(group)
        key = id(grp)
        cached = self._gloo_fast.get(key)
        if cached is None:
            if not self.is_initialized():
                return False
            cached = self.get_backend(grp).lower() == "gloo" and os.environ.get("DSCORE_GLOO_NATIVE", "0") != "1"
            self._gloo_fast[key] = cached
        return cached

    def new_group(self, ranks: Sequence[int], **kwargs: Any) -> Any:
        """A new process group of the global ``ranks`` (every rank of the default group must call this).

        Extra keyword arguments go to ``torch.distributed.new_group`` (``timeout``, ``backend``).
        """
        return dist.new_group(ranks=sorted(int(r) for r in ranks), **kwargs)

    def bound_to(self, group: Any) -> Comm:
        """A facade sharing this one's settings (backend, env, emulations) but bound to ``group``.

        Collectives with ``group=None`` then run on ``group`` and :attr:`rank` / :attr:`world_size` are
        ranks of it (a pipeline stage's data-parallel group, for example). It never owns the group.
        """
        other = Comm(group, backend=self.backend, env=self.env, registry=self.registry)
        other.native = self.native.copy()
        other.accelerator = self.accelerator
        return other

    @property
    def transports(self) -> tuple[Transport, ...]:
        """The registered transports of this facade, in asking order (built from :attr:`registry` on first
        use; :func:`dscore.comm.transports.registered_transports`)."""
        if self._transports is None:
            if self.registry is None:
                self.registry = default_registry()
            self._transports = registered_transports(
                self.registry, backend=self.backend, pairwise=self.gloo_fast, native=self.native
            )
        return self._transports

    # ---------------------------------------------------------------- helpers
    def _transport(self, op: str, grp: Any, eligible: bool, *tensors: torch.Tensor) -> Transport | None:
        """The registered transport that runs ``op`` on ``grp`` for these tensors, or None for the backend's
        own collective (:attr:`native`): see :func:`dscore.comm.transports.pick` (device tensors always
        take the backend's; ``eligible`` False skips asking)."""
        if not eligible:
            return None
        return pick(grp, True, tensors, op=op, transports=self.transports)

    @staticmethod
    def _require_floating(tensor: torch.Tensor, what: str) -> None:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise DistributedError(
                f"{what} with op 'avg' needs a floating tensor, got {tensor.dtype}; use op='sum' and divide"
            )

    # ---------------------------------------------------------------- collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: str | Any = "sum", group: Any = None, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` (any shape/dtype) across the group in place; every rank gets the result.

        ``op="avg"`` needs a floating dtype; where the backend lacks AVG it is SUM then ``/= world_size``.
        A one-rank group leaves ``tensor`` as it is.

        Returns:
            A :class:`Work` when ``async_op`` is True, else ``None``.
        """
        rop = reduce_op(op)
        grp = self._group(group)
        if _is_avg(rop):
            self._require_floating(tensor, "all_reduce")
        if self.get_world_size(grp) == 1:
            return _DONE if async_op else None
        eligible = _pairwise_op(rop) and tensor.is_contiguous() and tensor.dtype != torch.bool
        transport = self._transport("all_reduce", grp, eligible, tensor)
        if transport is not None:
            return transport.all_reduce(tensor.view(-1), rop, grp, async_op)
        return self.native.all_reduce(tensor, rop, grp, async_op)

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch.distributed's name
        op: str | Any = "sum",
        group: Any = None,
        async_op: bool = False,
        *,
        input_reusable: bool = False,
    ) -> Work | None:
        """Reduce ``input`` across ranks and keep this rank's equal slice in ``output``.

        Shapes: ``input.numel() == world_size * output.numel()``; rank ``r`` receives elements
        ``[r * n, (r + 1) * n)`` of the flattened reduced input (``n = output.numel()``); same dtype;
        ``output`` contiguous (any shapes otherwise: the tensors are viewed flat).

        Args:
            input_reusable: the caller does not need ``input`` afterwards, so the all-reduce fallback may
                run on it in place instead of a copy.

        ``output`` may alias this rank's slice of ``input`` on every path (the pairwise exchange and the
        emulation write it last; a backend's native call receives into a temporary that is copied in).

        Raises:
            DistributedError: the sizes do not match, or ``output`` is not contiguous.
        """
        grp = self._group(group)
        world = self.get_world_size(grp)
        n = output.numel()
        _require_contiguous(output, "reduce_scatter_tensor")
        if input.numel() != world * n:
            raise DistributedError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, expected world_size ({world}) x "
                f"output ({n}) = {world * n}"
            )
        rop = reduce_op(op)
        if _is_avg(rop):
            self._require_floating(input, "reduce_scatter_tensor")
        if world == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.reshape(output.shape))
            return _DONE if async_op else None
        transport = self._transport("reduce_scatter", grp, _pairwise_op(rop), input, output)
        if transport is not None:
            flat = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
            return transport.reduce_scatter(list(flat.split(n)), output, rop, grp, async_op)
        # on a pairwise (gloo, CPU) group, e.g. a reduce op the transports lack: the all-reduce emulation
        return self.native.reduce_scatter_tensor(
            output, input, rop, grp, async_op, reusable=input_reusable and input.is_contiguous(),
            emulate=self.gloo_fast(grp, input, output),
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: str | Any = "sum",
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce ``input_list[r]`` across ranks into ``output`` on rank ``r``.

        Shapes: ``len(input_list) == world_size``; every entry has ``output``'s shape and dtype.

        Raises:
            DistributedError: wrong list length or shapes.
        """
        grp = self._group(group)
        world = self.get_world_size(grp)
        if len(input_list) != world or any(t.shape != output.shape for t in input_list):
            raise DistributedError(
                f"reduce_scatter: expected {world} input tensors of shape {tuple(output.shape)}, got "
                f"{[tuple(t.shape) for t in input_list]}"
            )
        rop = reduce_op(op)
        if _is_avg(rop):
            self._require_floating(output, "reduce_scatter")
        if world == 1:
            output.copy_(input_list[0])
            return _DONE if async_op else None
        transport = self._transport("reduce_scatter", grp, _pairwise_op(rop) and output.is_contiguous(), output,
                                    *input_list)
        if transport is not None:
            chunks = [
                t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().view(-1) for t in input_list
            ]
            return transport.reduce_scatter(chunks, output, rop, grp, async_op)
        return self.native.reduce_scatter(list(input_list), output, rop, grp, async_op)

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch.distributed's name
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """Concatenate every rank's ``input`` into ``output`` (rank order along the flattened storage).

        Shapes: ``output.numel() == world_size * input.numel()``, same dtype; ``output`` contiguous (any
        shapes otherwise: the tensors are viewed flat). ``input`` may be this rank's chunk of ``output``.
        On gloo: a pairwise point-to-point exchange (module docstring).

        Raises:
            DistributedError: the sizes do not match, or ``output`` is not contiguous.
        """
        grp = self._group(group)
        world = self.get_world_size(grp)
        _require_contiguous(output, "all_gather_into_tensor")
        if output.numel() != world * input.numel():
            raise DistributedError(
                f"all_gather_into_tensor: output has {output.numel()} elements, expected world_size ({world}) x "
                f"input ({input.numel()}) = {world * input.numel()}"
            )
        n = input.numel()
        flat_out = output.view(-1)
        if world == 1:
            if flat_out.data_ptr() != input.data_ptr():
                flat_out.copy_(input.reshape(-1))
            return _DONE if async_op else None
        transport = self._transport("all_gather", grp, True, input, output)
        if transport is not None:
            return transport.all_gather(input.reshape(-1), list(flat_out.split(n)), grp, async_op)
        return self.native.all_gather_into_tensor(flat_out, input, grp, async_op)

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Work | None:
        """``tensor_list[r]`` receives rank ``r``'s ``tensor`` (``len(tensor_list) == world_size``, equal shapes;
        the outputs need not be contiguous with each other). On gloo with contiguous tensors: the pairwise
        exchange of :meth:`all_gather_into_tensor`, straight into each output."""
        grp = self._group(group)
        world = self.get_world_size(grp)
        if world == 1:
            if tensor_list[0].data_ptr() != tensor.data_ptr():
                tensor_list[0].copy_(tensor)
            return _DONE if async_op else None
        contiguous = tensor.is_contiguous() and all(t.is_contiguous() for t in tensor_list)
        transport = self._transport("all_gather", grp, contiguous, tensor, *tensor_list)
        return (transport or self.native).all_gather(tensor, tensor_list, grp, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Work | None:
        """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank (in place)."""
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return _DONE if async_op else None
        return self.native.broadcast(tensor, src, grp, async_op)

    def _members(self, grp: Any) -> list[int]:
        """The global ranks of ``grp`` in group-rank order (``range(world)`` for the default group)."""
        if grp is None or not self.is_initialized():
            return list(range(self.get_world_size(grp)))
        return [int(r) for r in dist.get_process_group_ranks(grp)]

    def group_ranks(self, group: Any = None) -> list[int]:
        """The global ranks of ``group`` (None: the bound group) in group-rank order."""
        return self._members(self._group(group))

    def _require_member(self, grp: Any, rank: int, call: str, arg: str) -> int:
        members = self._members(grp)
        if int(rank) not in members:
            raise DistributedError(f"{call}: {arg}={rank} is not a global rank of the group (its ranks: {members})")
        return int(rank)

    @staticmethod
    def _splits(sizes: Sequence[int] | None, rows: int, world: int, call: str, arg: str, what: str) -> list[int] | None:
        """``sizes`` checked against dim 0 (``rows``) of ``what``; None when the split is even."""
        if sizes is None:
            if rows % world != 0:
                raise DistributedError(
                    f"{call}: dim 0 of {what} ({rows}) does not divide by the group size {world}; pass {arg} "
                    "for an uneven split"
                )
            return None
        split = [int(n) for n in sizes]
        if len(split) != world or any(n < 0 for n in split) or sum(split) != rows:
            raise DistributedError(
                f"{call}: {arg}={list(sizes)} must be {world} non-negative sizes (one per rank of the group) "
                f"summing to dim 0 of {what} ({rows})"
            )
        return split

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """All-to-all along dim 0 (``torch.distributed.all_to_all_single``): chunk ``r`` of ``tensor`` goes to
        rank ``r``; chunk ``q`` of ``output`` comes from rank ``q`` (Ulysses, MoE dispatch).

        Shapes: ``tensor`` and ``output`` have at least one dimension, the same trailing dimensions and dtype;
        ``output`` is contiguous. Without split sizes, dim 0 divides by the group size and the shapes are
        equal (even chunks). ``input_split_sizes`` (``output_split_sizes``) gives the dim-0 length of each
        rank's chunk of ``tensor`` (``output``): one non-negative size per rank, summing to dim 0; rank
        ``q``'s ``input_split_sizes[r]`` must equal rank ``r``'s ``output_split_sizes[q]``.

        Raises:
            DistributedError: split sizes of the wrong length or sum (names the argument), dim 0 not
                divisible without them, mismatched trailing dimensions or dtypes, a non-contiguous output.
        """
        grp = self._group(group)
        world = self.get_world_size(grp)
        call = "all_to_all_single"
        if tensor.dim() == 0 or output.dim() == 0 or tensor.shape[1:] != output.shape[1:] or tensor.dtype != output.dtype:
            raise DistributedError(
                f"{call}: input {tuple(tensor.shape)} {tensor.dtype} and output {tuple(output.shape)} {output.dtype} "
                "need at least one dimension, the same trailing dimensions and the same dtype"
            )
        in_split = self._splits(input_split_sizes, tensor.shape[0], world, call, "input_split_sizes", "the input")
        out_split = self._splits(output_split_sizes, output.shape[0], world, call, "output_split_sizes", "the output")
        if in_split is None and out_split is None and tensor.shape != output.shape:
            raise DistributedError(
                f"{call}: an even split needs equal shapes; got input {tuple(tensor.shape)} and output "
                f"{tuple(output.shape)} (pass output_split_sizes / input_split_sizes for an uneven one)"
            )
        me = self.get_rank(grp)
        mine_in = in_split[me] if in_split is not None else tensor.shape[0] // world
        mine_out = out_split[me] if out_split is not None else output.shape[0] // world
        if mine_in != mine_out:
            raise DistributedError(
                f"{call}: this rank's own chunk has {mine_in} rows in input_split_sizes but {mine_out} in "
                f"output_split_sizes (rank {me} sends itself what it receives from itself)"
            )
        _require_contiguous(output, f"{call} output")
        if world == 1:
            if tensor.shape[0] != output.shape[0]:
                raise DistributedError(
                    f"{call}: on one rank the output receives the whole input; dim 0 is {tensor.shape[0]} in the "
                    f"input and {output.shape[0]} in the output"
                )
            if output.data_ptr() != tensor.data_ptr():
                output.copy_(tensor)
            return _DONE if async_op else None
        return self.native.all_to_all_single(output, tensor, grp, async_op, out_split, in_split)

    def all_to_all(
        self,
        output_tensor_list: Sequence[torch.Tensor],
        input_tensor_list: Sequence[torch.Tensor],
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """``input_tensor_list[r]`` goes to rank ``r``; ``output_tensor_list[q]`` receives rank ``q``'s entry
        for this rank (``torch.distributed.all_to_all``).

        Shapes: both lists have one tensor per rank of the group, all of one dtype and device; entry ``q``
        of the output has the element count of rank ``q``'s entry for this rank (any shapes). On gloo
        (which lacks this call) it runs as one uneven :meth:`all_to_all_single` of the flattened entries.

        Raises:
            DistributedError: list lengths other than the group size, or mixed dtypes or devices.
        """
        grp = self._group(group)
        world = self.get_world_size(grp)
        outs, ins = list(output_tensor_list), list(input_tensor_list)
        if len(outs) != world or len(ins) != world:
            raise DistributedError(
                f"all_to_all: output_tensor_list and input_tensor_list need {world} tensors each (one per rank), "
                f"got {len(outs)} and {len(ins)}"
            )
        if len({(t.dtype, t.device) for t in outs + ins}) != 1:
            raise DistributedError(
                "all_to_all: every tensor must have one dtype and device; got "
                f"{sorted({f'{t.dtype}@{t.device}' for t in outs + ins})}"
            )
        if world == 1:
            if outs[0].numel() != ins[0].numel():
                raise DistributedError(
                    f"all_to_all: on one rank output_tensor_list[0] ({outs[0].numel()} elements) receives "
                    f"input_tensor_list[0] ({ins[0].numel()} elements)"
                )
            if outs[0].data_ptr() != ins[0].data_ptr():
                outs[0].copy_(ins[0].reshape(outs[0].shape))
            return _DONE if async_op else None
        if ins[0].device.type != "cpu" or "gloo" not in self.get_backend(grp).lower():
            return result(dist.all_to_all(outs, [t.contiguous() for t in ins], group=grp, async_op=True), async_op)
        device = ins[0].device
        send = torch.cat([t.reshape(-1) for t in ins]) if ins else torch.empty(0, device=device)
        recv = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype, device=device)
        work = self.native.all_to_all_single(
            recv, send, grp, True, [t.numel() for t in outs], [t.numel() for t in ins]
        )

        def finish() -> None:
            for out, got in zip(outs, recv.split([t.numel() for t in outs])):
                out.copy_(got.view(out.shape))

        return launched([work], async_op, finish)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: str | Any = "sum", group: Any = None, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` (any shape/dtype) across the group into ``tensor`` on global rank ``dst``
        (``torch.distributed.reduce``; the other ranks' tensors are scratch afterwards, as torch's).

        ``op="avg"`` needs a floating dtype and runs as a sum divided by the group size on ``dst``.

        Raises:
            DistributedError: ``dst`` is not a rank of the group, an unknown op, avg of a non-floating tensor.
        """
        grp = self._group(group)
        rop = reduce_op(op)
        if _is_avg(rop):
            self._require_floating(tensor, "reduce")
        dst = self._require_member(grp, dst, "reduce", "dst")
        world = self.get_world_size(grp)
        if world == 1:
            return _DONE if async_op else None
        avg = _is_avg(rop)
        work = dist.reduce(tensor, dst, op=dist.ReduceOp.SUM if avg else rop, group=grp, async_op=True)
        mine = dist.get_rank() == dst

        def finish() -> None:
            if avg and mine:
                tensor.div_(world)

        return launched([work], async_op, finish)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """``gather_list[r]`` on global rank ``dst`` receives rank ``r``'s ``tensor`` (``torch.distributed.gather``).

        Shapes: on ``dst``, ``gather_list`` has one tensor per rank of the group, each of ``tensor``'s shape
        and dtype; on the other ranks it is None (or empty).

        Raises:
            DistributedError: ``dst`` is not a rank of the group, or ``gather_list`` is wrong for this rank.
        """
        grp = self._group(group)
        dst = self._require_member(grp, dst, "gather", "dst")
        world = self.get_world_size(grp)
        here = self._members(grp)[self.get_rank(grp)] if self.is_initialized() else 0
        if here == dst:
            if gather_list is None or len(gather_list) != world or any(
                t.shape != tensor.shape or t.dtype != tensor.dtype for t in gather_list
            ):
                got = None if gather_list is None else [(tuple(t.shape), t.dtype) for t in gather_list]
                raise DistributedError(
                    f"gather: on the destination rank {dst}, gather_list needs {world} tensors of shape "
                    f"{tuple(tensor.shape)} and dtype {tensor.dtype}; got {got}"
                )
        elif gather_list:
            raise DistributedError(f"gather: gather_list must be None on ranks other than dst={dst}")
        if world == 1:
            assert gather_list is not None
            if gather_list[0].data_ptr() != tensor.data_ptr():
                gather_list[0].copy_(tensor)
            return _DONE if async_op else None
        work = dist.gather(tensor.contiguous(), gather_list if here == dst else None, dst=dst, group=grp, async_op=True)
        return launched([work], async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None = None,
        src: int = 0,
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """Rank ``r`` receives ``scatter_list[r]`` of global rank ``src`` into ``tensor``
        (``torch.distributed.scatter``).

        Shapes: on ``src``, ``scatter_list`` has one tensor per rank of the group, each of ``tensor``'s shape
        and dtype; on the other ranks it is None (or empty).

        Raises:
            DistributedError: ``src`` is not a rank of the group, or ``scatter_list`` is wrong for this rank.
        """
        grp = self._group(group)
        src = self._require_member(grp, src, "scatter", "src")
        world = self.get_world_size(grp)
        here = self._members(grp)[self.get_rank(grp)] if self.is_initialized() else 0
        if here == src:
            if scatter_list is None or len(scatter_list) != world or any(
                t.shape != tensor.shape or t.dtype != tensor.dtype for t in scatter_list
            ):
                got = None if scatter_list is None else [(tuple(t.shape), t.dtype) for t in scatter_list]
                raise DistributedError(
                    f"scatter: on the source rank {src}, scatter_list needs {world} tensors of shape "
                    f"{tuple(tensor.shape)} and dtype {tensor.dtype}; got {got}"
                )
        elif scatter_list:
            raise DistributedError(f"scatter: scatter_list must be None on ranks other than src={src}")
        _require_contiguous(tensor, "scatter")
        if world == 1:
            assert scatter_list is not None
            if scatter_list[0].data_ptr() != tensor.data_ptr():
                tensor.copy_(scatter_list[0])
            return _DONE if async_op else None
        chunks = [t.contiguous() for t in scatter_list] if here == src and scatter_list is not None else None
        work = dist.scatter(tensor, chunks, src=src, group=grp, async_op=True)
        return launched([work], async_op)

    def all_reduce_coalesced(
        self, tensors: Sequence[torch.Tensor], op: str | Any = "sum", group: Any = None, async_op: bool = False
    ) -> Work | None:
        """:meth:`all_reduce` of every tensor of ``tensors`` (in place), as one flat all-reduce per dtype.

        Shapes: any; the tensors share one device. Results equal one :meth:`all_reduce` per tensor.

        Raises:
            DistributedError: tensors on different devices, an unknown op, avg of a non-floating tensor.
        """
        items = list(tensors)
        if len({t.device for t in items}) > 1:
            raise DistributedError(
                f"all_reduce_coalesced: the tensors must share one device; got {sorted({str(t.device) for t in items})}"
            )
        rop = reduce_op(op)
        if _is_avg(rop):
            for t in items:
                self._require_floating(t, "all_reduce_coalesced")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in items:
            by_dtype.setdefault(t.dtype, []).append(t)
        works: list[Any] = []
        flats: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for members in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            works.append(self.all_reduce(flat, rop, group=group, async_op=True))
            flats.append((flat, members))

        def finish() -> None:
            for flat, members in flats:
                for t, got in zip(members, flat.split([t.numel() for t in members])):
                    t.copy_(got.view(t.shape))

        return launched(works, async_op, finish)

    def all_gather_coalesced(
        self,
        output_tensors: Sequence[torch.Tensor],
        input_tensors: Sequence[torch.Tensor],
        group: Any = None,
        async_op: bool = False,
    ) -> Work | None:
        """:meth:`all_gather_into_tensor` of each ``(output_tensors[i], input_tensors[i])`` pair, all launched
        together (``deepspeed.comm.all_gather_coalesced``).

        Raises:
            DistributedError: lists of different lengths, or a pair whose sizes do not match (checked for
                every pair before anything is launched).
        """
        outs, ins = list(output_tensors), list(input_tensors)
        grp = self._group(group)
        world = self.get_world_size(grp)
        if len(outs) != len(ins):
            raise DistributedError(
                f"all_gather_coalesced: {len(outs)} output_tensors for {len(ins)} input_tensors; pass one output per input"
            )
        for i, (out, inp) in enumerate(zip(outs, ins)):
            if out.numel() != world * inp.numel() or not out.is_contiguous():
                raise DistributedError(
                    f"all_gather_coalesced: output_tensors[{i}] must be contiguous with world_size ({world}) x "
                    f"{inp.numel()} elements (input_tensors[{i}]); got {out.numel()}"
                )
        works = [self.all_gather_into_tensor(out, inp, group=group, async_op=True) for out, inp in zip(outs, ins)]
        return launched(works, async_op)

    # ---------------------------------------------------------------- point-to-point
    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, group: Any = None) -> None:
        """Send ``tensor`` to global rank ``dst`` and return once it was handed over (blocking).

        Point-to-point transfers (pipeline stages) go through the same Comm as the collectives, so a
        backend or group choice applies to them too. ``tag`` pairs a send with its :meth:`recv`.
        """
        dist.send(tensor, int(dst), group=self._group(group), tag=int(tag))

    def recv(self, tensor: torch.Tensor, src: int | None = None, *, tag: int = 0, group: Any = None) -> int:
        """Receive into ``tensor`` (its shape and dtype must match the sender's) from global rank ``src``
        (None: from any rank). Returns the sender's global rank."""
        return int(dist.recv(tensor, None if src is None else int(src), group=self._group(group), tag=int(tag)))

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, group: Any = None) -> Work:
        """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` alive and unchanged until the
        returned :class:`Work` is waited on."""
        return Work([dist.isend(tensor, int(dst), group=self._group(group), tag=int(tag))])

    def irecv(self, tensor: torch.Tensor, src: int | None = None, *, tag: int = 0, group: Any = None) -> Work:
        """Start receiving into ``tensor`` from global rank ``src`` (None: any rank); its contents are valid
        after ``wait()``."""
        return Work([dist.irecv(tensor, None if src is None else int(src), group=self._group(group), tag=int(tag))])

    def batch_isend_irecv(self, p2p_ops: Sequence[Any]) -> list[Work]:
        """Launch a batch of point-to-point transfers together (``torch.distributed.batch_isend_irecv``, which
        backends such as NCCL need to pair sends and receives without deadlocking).

        Each entry has ``op`` (``"isend"`` / ``"irecv"``, or ``torch.distributed.isend`` / ``irecv``),
        ``tensor``, ``peer`` (a global rank), ``group`` (None: this facade's) and ``tag`` attributes:
        a ``torch.distributed.P2POp`` or DeepSpeed's ``P2POp``. Returns one :class:`Work` per entry.

        Raises:
            DistributedError: an entry's ``op`` is neither kind, or the list is empty.
        """
        kinds = {"isend": dist.isend, "irecv": dist.irecv}
        ops = []
        for i, entry in enumerate(p2p_ops):
            kind = entry.op
            fn = kinds.get(kind) if isinstance(kind, str) else (kind if kind in kinds.values() else None)
            if fn is None:
                raise DistributedError(f"batch_isend_irecv: entry {i} has op={kind!r}; valid: 'isend', 'irecv'")
            group = getattr(entry, "group", None)
            ops.append(dist.P2POp(fn, entry.tensor, int(entry.peer), self._group(group), int(getattr(entry, "tag", 0))))
        if not ops:
            raise DistributedError("batch_isend_irecv: p2p_ops is empty; pass at least one isend/irecv operation")
        return [Work([w]) for w in dist.batch_isend_irecv(ops)]

    def all_gather_object(self, obj: Any, group: Any = None, *, device: torch.device | str | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (``[obj]`` on one rank).

        Runs :func:`dscore.comm.objects.all_gather_object` (a length exchange, then a padded ``uint8``
        all-gather on ``device``, default the group's :func:`~dscore.comm.objects.object_device`), not
        torch's, which needs numpy to unpickle.
        """
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return [obj]
        return objects.all_gather_object(obj, grp, device=device, accelerator=self.accelerator)

    def broadcast_object(
        self, obj: Any, src: int = 0, group: Any = None, *, device: torch.device | str | None = None
    ) -> Any:
        """Global rank ``src``'s picklable ``obj`` on every rank (:func:`dscore.comm.objects.broadcast_object`
        on ``device``, default the group's object device: no numpy needed)."""
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return obj
        return objects.broadcast_object(obj, int(src), grp, device=device, accelerator=self.accelerator)

    def barrier(self, group: Any = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Work | None:
        """Block until every rank of the group reaches the barrier (no-op on one rank).

        With ``async_op`` returns a :class:`Work` that completes once every rank arrived; ``device_ids``
        (NCCL) names the devices the barrier runs on, as ``torch.distributed.barrier``.
        """
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return _DONE if async_op else None
        kwargs: dict[str, Any] = {} if device_ids is None else {"device_ids": list(device_ids)}
        return result(dist.barrier(group=grp, async_op=async_op, **kwargs), async_op)

    def monitored_barrier(self, group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` (a ``timedelta``; None: the
        group's timeout); ``wait_all_ranks`` reports every missing rank rather than the first
        (``torch.distributed.monitored_barrier``, gloo groups only).

        Raises:
            RuntimeError: torch's, naming the missing rank(s), on timeout or on a backend without it.
        """
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return
        dist.monitored_barrier(group=grp, timeout=timeout, wait_all_ranks=bool(wait_all_ranks))

    def agree(
        self,
        error: BaseException | None,
        what: str,
        payload: Any = None,
        *,
        error_types: Sequence[type[DscoreError]] = (),
        default_error: type[DscoreError] = DistributedError,
    ) -> list[Any]:
        """All-gather ``(outcome, payload)`` of a phase; raise the same error on every rank when any failed.

        Args:
            error: this rank's exception in the phase, or None.
            what: the phase, for the message ("writing the checkpoint files").
            payload: picklable data to share with the other ranks on success.
            error_types: dscore error classes re-raised as themselves when a rank raised one (by class
                name); any other failure becomes ``default_error``.
            default_error: the class raised for other failures.

        Returns:
            every rank's ``payload`` in rank order.

        Raises:
            one of ``error_types`` or ``default_error``: one or more ranks failed; the message names each
                failing rank and its error (the local exception is chained when this rank failed).
        """
        mine = (RankFailure(error) if error is not None else None, payload)
        gathered = self.all_gather_object(mine)
        failures = [(r, f) for r, (f, _) in enumerate(gathered) if f is not None]
        if not failures:
            return [p for _, p in gathered]
        world = len(gathered)
        if len(failures) == 1 or all(f.message == failures[0][1].message for _, f in failures):
            r0, f0 = failures[0]
            where = (
                ""
                if world == 1
                else (f" (on rank {r0})" if len(failures) == 1 else f" (on ranks {[r for r, _ in failures]})")
            )
            message = f"{f0.message}{where}" if f0.own else f"{what} failed{where}: {f0.message}"
        else:
            message = f"{what} failed on {len(failures)} rank(s): " + "; ".join(
                f"rank {r}: {f.message}" for r, f in failures
            )
        by_name = {cls.__name__: cls for cls in error_types}
        cls = by_name.get(failures[0][1].type_name, default_error)
        raise cls(message) from error

    def destroy(self) -> bool:
        """Destroy the default process group if dscore created it and this facade is bound to it.

        A group the user created is left alone (it is the user's to destroy). Returns True when the
        group was destroyed.
        """
        owner = Comm.group_owner
        if self.group is not None or owner is None:  # no owner: dscore.init_distributed never ran here
            return False
        return bool(owner.destroy("Comm.destroy() was called"))


# wrappers registered through dscore.comm.instrument (the comm plugin's comms logger) apply to its collectives
instrumentable(Comm)
