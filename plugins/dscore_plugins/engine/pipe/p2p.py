"""Point-to-point transfer of activations and gradients between neighbouring pipeline stages.

A stage sends a tensor or a tuple of tensors to the next stage (activations) or to the previous one
(gradients). The *meta* — number of tensors, dtypes, shapes, which need a gradient — is sent once, with
the first transfer on a link; later transfers reuse it (DeepSpeed's shape exchange), and a sender whose
output changes shape or dtype gets a :class:`PipelineError` naming the difference instead of a hang or a
corrupted receive. Sends are asynchronous (``isend``; their handles are waited for before the step
ends), receives block; with the 1F1B order this is deadlock-free on gloo, NCCL and others.

No tags: NCCL ignores them, so messages between two ranks are matched in the order they are posted.
Correctness rests on that order alone — each direction of a link carries the meta once, then every
micro-batch's tensors in micro-batch order (1F1B forwards and backwards both run micro-batches 0, 1, ...).
Each link checks the order it is asked to send and receive in, so a schedule that would post them in
another order is a :class:`PipelineError` on the spot instead of a silently swapped tensor. Two links to
the same peer (the labels the first stage sends the last one, ``channel=1``, next to the activations when
the two stages are adjacent) share that order too: the engine posts a micro-batch's activations and then
its labels, and receives them in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dscore.pipe import PipelineError

if TYPE_CHECKING:
    from dscore.comm import Comm

__all__ = ["P2PLink", "as_tuple"]

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_META, _ACT, _GRAD = 1, 2, 3
_MAX_TENSORS = 64


def as_tuple(x: Any, where: str) -> tuple[torch.Tensor, ...]:
    """``x`` as a tuple of tensors.

    Raises:
        PipelineError: ``x`` is not a tensor or a tuple/list of tensors (``where`` names the stage).
    """
    items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise PipelineError(
            f"{where} must output a tensor or a tuple of tensors to send to the next stage, got "
            f"{type(x).__name__}{'' if not isinstance(x, (tuple, list)) else ' of ' + ', '.join(type(t).__name__ for t in items)}"
        )
    if len(items) > _MAX_TENSORS:
        raise PipelineError(f"{where} outputs {len(items)} tensors; at most {_MAX_TENSORS} can cross a stage boundary")
    return items


class P2PLink:
    """The connection of this stage to one neighbour (``peer`` is its global rank).

    Args:
        peer: the neighbour's global rank.
        device: where received tensors are allocated.
        comm: the :class:`dscore.comm.Comm` the transfers go through.
        channel: 0 for activations/gradients; 1 for a second link to the same peer (labels). Named in
            errors only: no tags are sent (see the module docstring).
    """

    def __init__(self, peer: int, device: torch.device, comm: Comm, channel: int = 0) -> None:
        self.peer = int(peer)
        self.channel = int(channel)
        self.comm = comm
        self.device = device
        self.send_meta: list[tuple[torch.dtype, tuple[int, ...], bool]] | None = None
        self.recv_meta: list[tuple[torch.dtype, tuple[int, ...], bool]] | None = None
        self._pending: list[Any] = []
        self._next: dict[str, int] = {}

    def _in_order(self, what: str, micro_batch: int) -> None:
        """Check that ``what`` ("send activations", ...) happens for micro-batches 0, 1, 2, ... in order.

        Raises:
            PipelineError: ``micro_batch`` is not the next one on this direction of the link.
        """
        expected = 0 if micro_batch == 0 else self._next.get(what, 0)  # micro-batch 0 starts a new batch
        if micro_batch != expected:
            raise PipelineError(
                f"pipeline link with rank {self.peer} (channel {self.channel}): asked to {what} of micro-batch "
                f"{micro_batch}, but the next "
                f"one in order is {expected}; messages between two stages are matched in the order they are "
                "posted (NCCL has no tags), so both stages must post them in micro-batch order"
            )
        self._next[what] = micro_batch + 1

    # ---------------------------------------------------------------- meta
    @staticmethod
    def _describe(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.dtype, tuple[int, ...], bool]]:
        return [(t.dtype, tuple(t.shape), bool(t.is_floating_point() and t.requires_grad)) for t in tensors]

    def _send_meta(self, meta: list[tuple[torch.dtype, tuple[int, ...], bool]]) -> None:
        flat: list[int] = [len(meta)]
        for dtype, shape, grad in meta:
            if dtype not in _DTYPES:
                raise PipelineError(f"cannot send a tensor of dtype {dtype} between stages; supported: {_DTYPES}")
            flat += [_DTYPES.index(dtype), int(grad), len(shape), *shape]
        # on the link's device: NCCL moves device tensors only
        header = torch.tensor([len(flat)], dtype=torch.int64, device=self.device)
        body = torch.tensor(flat, dtype=torch.int64, device=self.device)
        self.comm.send(header, self.peer)
        self.comm.send(body, self.peer)

    def _recv_meta(self) -> list[tuple[torch.dtype, tuple[int, ...], bool]]:
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        self.comm.recv(header, self.peer)
        body = torch.empty(int(header.item()), dtype=torch.int64, device=self.device)
        self.comm.recv(body, self.peer)
        vals = body.tolist()
        count, pos = vals[0], 1
        meta = []
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[vals[pos]], bool(vals[pos + 1]), vals[pos + 2]
            shape = tuple(vals[pos + 3 : pos + 3 + ndim])
            pos += 3 + ndim
            meta.append((dtype, shape, grad))
        return meta

    # ---------------------------------------------------------------- activations (forward direction)
    def send_activations(self, tensors: tuple[torch.Tensor, ...], micro_batch: int, where: str) -> None:
        """Send a stage's outputs (asynchronously); the first call also sends their meta.

        Raises:
            PipelineError: the outputs differ in number, dtype or shape from the first micro-batch's.
        """
        self._in_order("send activations", micro_batch)
        meta = self._describe(tensors)
        if self.send_meta is None:
            self._send_meta(meta)
            self.send_meta = meta
        elif [(d, s) for d, s, _ in meta] != [(d, s) for d, s, _ in self.send_meta]:
            raise PipelineError(
                f"{where} output changed from {[(str(d), s) for d, s, _ in self.send_meta]} to "
                f"{[(str(d), s) for d, s, _ in meta]} (dtype, shape); activation shapes are exchanged once, so every "
                "micro-batch must have the same shapes (pad the batch, or use equal micro-batch sizes)"
            )
        for t in tensors:
            buf = t.detach().contiguous()  # kept alive in _pending until the send completed
            self._pending.append((self.comm.isend(buf, self.peer), buf))

    def recv_activations(self, micro_batch: int, *, requires_grad: bool) -> tuple[torch.Tensor, ...]:
        """Receive the previous stage's outputs; with ``requires_grad`` floating tensors require grad (in
        training a gradient goes back for every floating tensor, see :meth:`send_gradients`)."""
        self._in_order("receive activations", micro_batch)
        if self.recv_meta is None:
            self.recv_meta = self._recv_meta()
        out = []
        for dtype, shape, _ in self.recv_meta:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.recv(buf, self.peer)
            if requires_grad and buf.is_floating_point():
                buf.requires_grad_(True)
            out.append(buf)
        return tuple(out)

    # ---------------------------------------------------------------- gradients (backward direction)
    def send_gradients(self, grads: list[torch.Tensor], micro_batch: int) -> None:
        """Send the gradient of every floating-point input received for ``micro_batch``, in order
        (zeros for an input that got none), asynchronously."""
        self._in_order("send gradients", micro_batch)
        for g in grads:
            buf = g.contiguous()
            self._pending.append((self.comm.isend(buf, self.peer), buf))

    def recv_gradients(self, micro_batch: int) -> list[torch.Tensor]:
        """Receive the gradients of the floating-point tensors sent with :meth:`send_activations`, in order."""
        assert self.send_meta is not None, "gradients received before any activation was sent"
        self._in_order("receive gradients", micro_batch)
        out = []
        k = 0
        for dtype, shape, _ in self.send_meta:
            if not dtype.is_floating_point:
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.recv(buf, self.peer)
            out.append(buf)
            k += 1
        return out

    def wait(self) -> None:
        """Wait for every pending send (their tensors are kept alive until then)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
