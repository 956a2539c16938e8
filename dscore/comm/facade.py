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

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from dscore.comm import objects
from dscore.comm.instrument import instrumentable
from dscore.comm.transports import Transport, current_registry, default_registry, pick, registered_transports
from dscore.comm.transports.native import NativeTransport
from dscore.comm.work import DONE, Work
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
}

def reduce_op(op: str | Any) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op`` (a name, case-insensitive, or a ReduceOp).

    Raises:
        DistributedError: unknown name; the message lists the valid ones.
    """
    if not isinstance(op, str):
        return op
    try:
        return _OPS[op.lower()]
    except KeyError:
        raise DistributedError(f"unknown reduce op {op!r}; valid: {', '.join(sorted(_OPS))}") from None


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

    def all_to_all_single(
        self, output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Work | None:
        """Equal-split all-to-all along dim 0: chunk ``r`` of ``tensor`` goes to rank ``r``, chunk ``q`` of
        ``output`` comes from rank ``q`` (dim 0 divisible by the world size, same shapes; Ulysses uses it).

        Raises:
            ValueError: dim 0 of ``tensor`` does not divide by the group size, or the shapes differ.
        """
        grp = self._group(group)
        world = self.get_world_size(grp)
        if tensor.shape != output.shape or tensor.shape[0] % world != 0:
            raise ValueError(
                f"all_to_all_single needs equal shapes with dim 0 divisible by the group size {world}; got input "
                f"{tuple(tensor.shape)} and output {tuple(output.shape)}"
            )
        if world == 1:
            if output.data_ptr() != tensor.data_ptr():
                output.copy_(tensor)
            return _DONE if async_op else None
        _require_contiguous(output, "all_to_all_single output")
        return self.native.all_to_all_single(output, tensor, grp, async_op)

    # ---------------------------------------------------------------- point-to-point
    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, group: Any = None) -> None:
        """Send ``tensor`` to global rank ``dst`` and return once it was handed over (blocking).

        Point-to-point transfers (pipeline stages) go through the same Comm as the collectives, so a
        backend or group choice applies to them too. ``tag`` pairs a send with its :meth:`recv`.
        """
        dist.send(tensor, int(dst), group=self._group(group), tag=int(tag))

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, group: Any = None) -> None:
        """Receive into ``tensor`` (its shape and dtype must match the sender's) from global rank ``src``."""
        dist.recv(tensor, int(src), group=self._group(group), tag=int(tag))

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, group: Any = None) -> Work:
        """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` alive and unchanged until the
        returned :class:`Work` is waited on."""
        return Work([dist.isend(tensor, int(dst), group=self._group(group), tag=int(tag))])

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, group: Any = None) -> Work:
        """Start receiving into ``tensor`` from global rank ``src``; its contents are valid after ``wait()``."""
        return Work([dist.irecv(tensor, int(src), group=self._group(group), tag=int(tag))])

    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (``[obj]`` on one rank).

        Runs :func:`dscore.comm.objects.all_gather_object` (a length exchange, then a padded ``uint8``
        all-gather on the group's :func:`~dscore.comm.objects.object_device`), not torch's, which needs
        numpy to unpickle.
        """
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return [obj]
        return objects.all_gather_object(obj, grp, accelerator=self.accelerator)

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """Global rank ``src``'s picklable ``obj`` on every rank (:func:`dscore.comm.objects.broadcast_object`:
        no numpy needed)."""
        grp = self._group(group)
        if self.get_world_size(grp) == 1:
            return obj
        return objects.broadcast_object(obj, int(src), grp, accelerator=self.accelerator)

    def barrier(self, group: Any = None) -> None:
        """Block until every rank of the group reaches the barrier (no-op on one rank)."""
        if self.get_world_size(self._group(group)) == 1:
            return
        dist.barrier(group=self._group(group))

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
