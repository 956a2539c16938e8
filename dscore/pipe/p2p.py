"""Point-to-point transfer of activations and gradients between neighbouring pipeline stages.

A stage sends a tensor or a tuple of tensors to the next stage (activations) or to the previous one
(gradients). The *meta* — number of tensors, dtypes, shapes, which need a gradient — is sent once, with
the first transfer on a link; later transfers reuse it (DeepSpeed's shape exchange), and a sender whose
output changes shape or dtype gets a :class:`PipelineError` naming the difference instead of a hang or a
corrupted receive. Sends are asynchronous (``isend``; their handles are waited for before the step
ends), receives block; with the 1F1B order this is deadlock-free on gloo, NCCL and others.

Tags keep messages of one link apart: ``tag = kind * 2**20 + micro_batch * 64 + tensor_index`` (kinds:
meta, activation, gradient). A second link to the same peer on another ``channel`` (the labels the first
stage sends the last one) uses its own kinds, so its messages never match the first link's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import DscoreError

if TYPE_CHECKING:
    from dscore.comm import Comm

__all__ = ["P2PLink", "PipelineError", "as_tuple"]

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


class PipelineError(DscoreError, RuntimeError):
    """The pipeline cannot run as asked (a stage output that changed shape, a non-tensor output, a
    direct ``forward``/``backward``/``step`` call on the pipeline engine, ...)."""


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


def _tag(kind: int, micro_batch: int, index: int) -> int:
    return kind * (1 << 20) + (micro_batch % (1 << 14)) * _MAX_TENSORS + index


class P2PLink:
    """The connection of this stage to one neighbour (``peer`` is its global rank).

    Args:
        peer: the neighbour's global rank.
        device: where received tensors are allocated.
        comm: the :class:`dscore.comm.Comm` the transfers go through.
        channel: 0 for activations/gradients; 1 for a second link to the same peer (labels).
    """

    def __init__(self, peer: int, device: torch.device, comm: Comm, channel: int = 0) -> None:
        self.peer = int(peer)
        self._kind = 4 * int(channel)  # added to every tag kind
        self.comm = comm
        self.device = device
        self.send_meta: list[tuple[torch.dtype, tuple[int, ...], bool]] | None = None
        self.recv_meta: list[tuple[torch.dtype, tuple[int, ...], bool]] | None = None
        self._pending: list[Any] = []

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
        self.comm.send(header, self.peer, tag=_tag(self._kind + _META, 0, 0))
        self.comm.send(body, self.peer, tag=_tag(self._kind + _META, 0, 1))

    def _recv_meta(self) -> list[tuple[torch.dtype, tuple[int, ...], bool]]:
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        self.comm.recv(header, self.peer, tag=_tag(self._kind + _META, 0, 0))
        body = torch.empty(int(header.item()), dtype=torch.int64, device=self.device)
        self.comm.recv(body, self.peer, tag=_tag(self._kind + _META, 0, 1))
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
        for i, t in enumerate(tensors):
            buf = t.detach().contiguous()  # kept alive in _pending until the send completed
            self._pending.append((self.comm.isend(buf, self.peer, tag=_tag(self._kind + _ACT, micro_batch, i)), buf))

    def recv_activations(self, micro_batch: int, *, requires_grad: bool) -> tuple[torch.Tensor, ...]:
        """Receive the previous stage's outputs; with ``requires_grad`` floating tensors require grad (in
        training a gradient goes back for every floating tensor, see :meth:`send_gradients`)."""
        if self.recv_meta is None:
            self.recv_meta = self._recv_meta()
        out = []
        for i, (dtype, shape, _) in enumerate(self.recv_meta):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.recv(buf, self.peer, tag=_tag(self._kind + _ACT, micro_batch, i))
            if requires_grad and buf.is_floating_point():
                buf.requires_grad_(True)
            out.append(buf)
        return tuple(out)

    # ---------------------------------------------------------------- gradients (backward direction)
    def send_gradients(self, grads: list[torch.Tensor], micro_batch: int) -> None:
        """Send the gradient of every floating-point input received for ``micro_batch``, in order
        (zeros for an input that got none), asynchronously."""
        for i, g in enumerate(grads):
            buf = g.contiguous()
            self._pending.append((self.comm.isend(buf, self.peer, tag=_tag(self._kind + _GRAD, micro_batch, i)), buf))

    def recv_gradients(self, micro_batch: int) -> list[torch.Tensor]:
        """Receive the gradients of the floating-point tensors sent with :meth:`send_activations`, in order."""
        assert self.send_meta is not None, "gradients received before any activation was sent"
        out = []
        k = 0
        for dtype, shape, _ in self.send_meta:
            if not dtype.is_floating_point:
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.recv(buf, self.peer, tag=_tag(self._kind + _GRAD, micro_batch, k))
            out.append(buf)
            k += 1
        return out

    def wait(self) -> None:
        """Wait for every pending send (their tensors are kept alive until then)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
