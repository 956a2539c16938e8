"""Ulysses data and loss helpers: the sequence-sharding data loader adapter and a differentiable all-gather
(see :mod:`dscore_plugins.parallel.ulysses.attention` for the design)."""

from __future__ import annotations

import logging
import math
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dscore.errors import ConfigError, DscoreError
from dscore.zero.optimizer import collective_device
from dscore_plugins.parallel.ulysses.attention import as_comm

__all__ = ["UlyssesSPDataLoaderAdapter", "all_gather_differentiable"]

log = logging.getLogger("dscore.parallel.ulysses")


def _all_gather_sum_backward(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return _GatherAll.apply(x, comm)  # type: ignore[no-any-return]


class _GatherAll(torch.autograd.Function):
    """Stacked all-gather ``[world, *x.shape]``; backward sums every rank's gradient for this rank's slot
    (a reduce-scatter, as ``torch.distributed.nn.functional.all_gather``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any) -> torch.Tensor:
        ctx.comm = comm
        x = x.contiguous()
        outs = [torch.empty_like(x) for _ in range(int(comm.world_size))]
        comm.all_gather(outs, x)
        return torch.stack(outs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad[int(ctx.comm.rank)], None


def all_gather_differentiable(tensor: torch.Tensor, comm: Any) -> torch.Tensor:
    """Every rank's ``tensor`` stacked (``[world, *shape]``), differentiable.

    The backward sums, over the group, the gradient each rank computed for this rank's entry. With a loss
    every sequence-parallel rank computes identically (the token-weighted mean of the per-rank losses), the
    engine's average over the sequence x data ranks then gives exactly the gradient of that loss::

        losses = all_gather_differentiable(local_mean_loss, mesh.sp_comm)
        counts = all_gather_differentiable(local_valid_tokens.float(), mesh.sp_comm)
        loss = (losses * counts).sum() / counts.sum()
    """
    comm = as_comm(comm)
    if comm is None or int(comm.world_size) == 1:
        return tensor.unsqueeze(0)
    return _all_gather_sum_backward(tensor, comm)


_PADDED_MASK_WARNED = False


def _warn_padded_mask(mask: Any) -> None:
    """Warn once per process when a dropped ``attention_mask`` had padding (a zero anywhere).

    Ulysses attends causally by ``position_ids`` over the whole sequence, so padded positions are attended
    to as if they were tokens (DeepSpeed drops the mask the same way, without a word). The check stops
    after the warning: one reduction over ``[b, S]`` per batch until then.
    """
    global _PADDED_MASK_WARNED
    if _PADDED_MASK_WARNED or not isinstance(mask, torch.Tensor) or not bool((mask == 0).any()):
        return
    _PADDED_MASK_WARNED = True
    log.warning(
        "UlyssesSPDataLoaderAdapter dropped an attention_mask with padding (%d of %d positions are 0): "
        "sequence-parallel attention is causal by position_ids and ignores the mask, as in DeepSpeed, so padded "
        "tokens are attended to; give them labels -100 (their loss is then ignored) or pack sequences without "
        "padding (warned once per process)",
        int((mask == 0).sum()),
        mask.numel(),
    )


_NO_BATCH, _BATCH, _NOT_A_BATCH = 0, 1, 2


def _signature(batch: dict[Any, Any]) -> tuple[int, str]:
    """A process-independent checksum of a batch's keys, tensor dtypes and tensor ranks (with its text), so
    the ranks can check they are about to exchange the same tensors before exchanging them."""
    parts = []
    for key in sorted(batch, key=str):
        value = batch[key]
        parts.append(f"{key}:{value.dtype}:{value.dim()}" if isinstance(value, torch.Tensor) else f"{key}:object")
    text = ", ".join(parts)
    return zlib.crc32(text.encode()), text


def _same_batch(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if value.shape != other.shape or not torch.equal(value, other.to(value.device)):
                return False
        else:
            try:
                if not bool(value == other):
                    return False
            except Exception:  # an object without a usable == (an array): not provably the same
                return False
    return True


class UlyssesSPDataLoaderAdapter:
    """Iterate ``dl`` yielding this rank's sequence shard of batches (DeepSpeed's class of the same name).

    Each batch is a dict with ``input_ids`` ``[b, S]`` and optionally ``labels``, ``position_ids``,
    ``attention_mask`` and other tensors or objects. The ranks of the sequence-parallel group exchange their
    batches (collectively: every rank of the group must build and iterate the adapter), and the first batch
    decides, the same way on every rank, which of two inputs the loader gives:

    * **different batches per rank** (DeepSpeed's semantics: Accelerate's loader shards over every process):
      each batch the ranks pull is all-gathered, and every rank yields, in rank order, its shard of each
      rank's batch, so one pull gives ``sp`` steps and ``len(adapter) == len(dl) * sp``. With one
      data-parallel rank the steps see rank 0's batch, then rank 1's, ..., then each rank's second batch.
    * **the same batch on every rank** (dscore's loaders: ``engine.training_dataloader`` shards over
      data-parallel ranks only): one shard per batch, ``len(adapter) == len(dl)``; every later batch is
      checked to be the same on every rank too (a divergence is refused: gathering it instead would change
      the number of steps mid-run). DeepSpeed's rule applied here would train each batch ``sp`` times.

    The first batch is pulled and exchanged in ``__init__`` (DeepSpeed creates its iterator there too), so
    ``len`` is known before iterating; the adapter is its own iterator (``iter`` returns it) and starts a
    new pass over ``dl`` after each ``StopIteration``, keeping the mode.

    Sharding, per batch: labels are shifted on the full sequence first (``shift_labels[:, i] =
    labels[:, i + 1]``, ``-100`` at the end) so no target crosses a shard boundary; the yielded dict holds
    ``shift_labels`` instead of ``labels``, ``position_ids`` of the global sequence (``arange(S)`` when
    missing, where DeepSpeed refuses: that is the positions an unsharded model uses), tensors of ``>= 2``
    dims whose last dim is ``S`` cut to the rank's ``S / sp`` slice, other values as they are, all on
    ``device`` (DeepSpeed: on the CPU); and no ``attention_mask`` (DeepSpeed keeps its shard, which its
    attention ignores; attention is causal by position, and a mask with padding, any 0, is logged as a
    warning once per process: padded tokens are attended to). Ranks may differ in ``S`` (each batch is
    sharded at its own length) but not in batch size.

    Raises (``__init__`` or iterating; the same error on every rank of the group):
        ConfigError: ``S`` not divisible by ``sp_world_size`` (pad the batch to a multiple); the group's size
            is not ``sp_world_size``.
        DscoreError: a batch is not a dict with an ``input_ids`` tensor of ``>= 2`` dims; the ranks' batches
            differ in batch size, or in keys / dtypes / tensor ranks; some ranks' loaders ran out before
            others (DeepSpeed would hang); in the same-batch mode, a later batch differs between ranks.
    """

    def __init__(self, dl: Iterable[Any], sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.comm, self.sp = dl, int(sp_rank), as_comm(sp_group), int(sp_world_size)
        if self.comm is not None and int(self.comm.world_size) != self.sp:
            raise ConfigError(
                f"UlyssesSPDataLoaderAdapter: sp_world_size {self.sp} but the group has {self.comm.world_size} ranks",
                path="sequence_parallel_size",
            )
        self.device = torch.device(device) if device is not None else None
        #: "gather" (different batches per rank) or "same" (one batch for the group); None until a first batch
        self.mode: str | None = "same" if self.sp == 1 else None
        self._it: Iterator[Any] | None = iter(dl)
        self._queue: deque[dict[str, Any]] = deque()
        self._pulled = 0
        self._ended = not self._pull()

    def __len__(self) -> int:
        n = len(self.dl)  # type: ignore[arg-type]
        return n * self.sp if self.mode == "gather" else n

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        while not self._queue:
            if self._ended or not self._pull():
                self._ended, self._it = False, None  # the next pass starts a fresh iterator over dl
                raise StopIteration
        return self.shard(self._queue.popleft())

    def _pull(self) -> bool:
        """Pull one batch from ``dl`` on every rank, exchange, queue the batches this rank trains; False
        (on every rank alike) when the loaders are exhausted."""
        if self._it is None:
            self._it = iter(self.dl)
        try:
            batch, state = next(self._it), _BATCH
        except StopIteration:
            batch, state = None, _NO_BATCH
        if state == _BATCH and not (
            isinstance(batch, dict)
            and isinstance(batch.get("input_ids"), torch.Tensor)
            and batch["input_ids"].dim() >= 2
        ):
            state = _NOT_A_BATCH
        index = self._pulled
        if self.sp == 1:
            if state == _NOT_A_BATCH:
                raise DscoreError(self._not_a_batch([self.sp_rank]))
            if state == _NO_BATCH:
                return False
            self._pulled += 1
            self._queue.append(batch)
            return True
        gathered = self._gather(batch, state, index)
        if gathered is None:
            return False
        self._pulled += 1
        same = all(_same_batch(gathered[0], g) for g in gathered[1:])
        if self.mode is None:
            self.mode = "same" if same else "gather"
            log.info(
                "UlyssesSPDataLoaderAdapter: the sequence-parallel ranks' first batches are %s: %s",
                "the same" if same else "different",
                "one shard per batch" if same else f"every rank's batch is sharded ({self.sp} steps per pull)",
            )
        elif self.mode == "same" and not same:
            raise DscoreError(
                f"UlyssesSPDataLoaderAdapter: batch {index} differs between the ranks of the sequence-parallel group, "
                "but their first batch was the same, so the adapter trains one batch per step for the group; give "
                "every rank the same batches throughout (shard the data over data-parallel ranks only, as "
                "engine.training_dataloader does), or different batches from the first (DeepSpeed's semantics: "
                "each rank's batch is gathered and sharded)"
            )
        self._queue.extend([batch] if self.mode == "same" else gathered)
        return True

    def _not_a_batch(self, ranks: list[int]) -> str:
        return (
            "UlyssesSPDataLoaderAdapter needs batches that are dicts with an 'input_ids' tensor [b, S] (2 or more "
            f"dims); sequence-parallel rank(s) {ranks} got something else"
        )

    def _gather(self, batch: Any, state: int, index: int) -> list[dict[str, Any]] | None:
        """Every rank's batch ``index`` in rank order (this rank's own object at its position), None when
        every rank's loader is exhausted; headers first so a mismatch is refused on every rank, not hung."""
        ids = batch["input_ids"] if state == _BATCH else None
        dev = collective_device([ids] if ids is not None else [], device=self.device)
        sig, text = _signature(batch) if state == _BATCH else (0, "")
        dims = (int(ids.shape[0]), int(ids.shape[-1])) if ids is not None else (0, 0)
        header = torch.tensor([state, sig, *dims], dtype=torch.int64, device=dev)
        heads = [torch.empty_like(header) for _ in range(self.sp)]
        self.comm.all_gather(heads, header)
        rows = [[int(v) for v in h.tolist()] for h in heads]
        states = [r[0] for r in rows]
        if all(s == _NO_BATCH for s in states):
            return None
        if _NOT_A_BATCH in states:
            raise DscoreError(self._not_a_batch([r for r, s in enumerate(states) if s == _NOT_A_BATCH]))
        if _NO_BATCH in states:
            done = [r for r, s in enumerate(states) if s == _NO_BATCH]
            raise DscoreError(
                f"UlyssesSPDataLoaderAdapter: the data loaders of the sequence-parallel group ran out at different "
                f"batches: rank(s) {done} have no batch {index}, the others have one; every rank of the group must "
                "get the same number of batches (a DistributedSampler with drop_last, or equal-length shards)"
            )
        if len({r[1] for r in rows}) > 1:
            raise DscoreError(
                "UlyssesSPDataLoaderAdapter: the ranks of the sequence-parallel group received batches with different "
                f"keys, dtypes or tensor ranks (batch {index}; sequence-parallel rank {self.sp_rank} has {text}); "
                "every rank's loader must produce batches of one structure"
            )
        if len({r[2] for r in rows}) > 1:
            sizes = ", ".join(f"rank {r}: {row[2]}" for r, row in enumerate(rows))
            raise DscoreError(
                f"UlyssesSPDataLoaderAdapter: the ranks of the sequence-parallel group received batches of different "
                f"sizes (batch {index}; {sizes}); Ulysses attention exchanges [b, S/sp] shards and needs the same "
                "batch size on every rank (drop the short last batch: drop_last=True / dataloader_drop_last=True)"
            )
        keys = list(batch)
        tensor_keys = sorted((k for k in keys if isinstance(batch[k], torch.Tensor)), key=str)
        object_keys = sorted((k for k in keys if not isinstance(batch[k], torch.Tensor)), key=str)
        # shapes next (equal signatures: equal counts of dims), then each tensor flat, padded to the longest
        mine = torch.tensor([d for k in tensor_keys for d in batch[k].shape], dtype=torch.int64, device=dev)
        all_shapes = [torch.empty_like(mine) for _ in range(self.sp)]
        self.comm.all_gather(all_shapes, mine)
        shape_rows = [s.tolist() for s in all_shapes]
        out: list[dict[Any, Any]] = [{} for _ in range(self.sp)]
        at = 0
        for key in tensor_keys:
            value = batch[key]
            n = value.dim()
            shapes = [tuple(int(d) for d in row[at : at + n]) for row in shape_rows]
            at += n
            numels = [math.prod(s) for s in shapes]
            wire = value.detach().reshape(-1).to(dev)
            if wire.dtype == torch.bool:  # not every backend reduces / gathers bool
                wire = wire.to(torch.uint8)
            longest = max(numels)
            if wire.numel() < longest:
                wire = torch.cat([wire, wire.new_zeros(longest - wire.numel())])
            recv = [torch.empty_like(wire) for _ in range(self.sp)]
            self.comm.all_gather(recv, wire)
            for r in range(self.sp):
                out[r][key] = recv[r][: numels[r]].reshape(shapes[r]).to(value.dtype)
        if object_keys:
            objects = self.comm.all_gather_object({k: batch[k] for k in object_keys})
            for r in range(self.sp):
                out[r].update(objects[r])
        out[self.sp_rank] = batch
        return [{k: o[k] for k in keys} for o in out]

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard of one batch (see the class docstring)."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise DscoreError("UlyssesSPDataLoaderAdapter needs batches that are dicts with an 'input_ids' tensor")
        ids = batch["input_ids"]
        b, s = ids.shape[0], ids.shape[-1]
        if s % self.sp:
            raise ConfigError(
                f"sequence length {s} is not divisible by sequence_parallel_size {self.sp}; pad every batch to a "
                f"multiple of {self.sp} (labels -100 on the padding)",
                path="sequence_parallel_size",
            )
        out: dict[str, Any] = {}
        full = dict(batch)
        _warn_padded_mask(full.pop("attention_mask", None))
        if "position_ids" not in full:
            full["position_ids"] = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
        if "labels" in full:
            labels = full.pop("labels")
            full["shift_labels"] = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
        chunk = s // self.sp
        lo, hi = self.sp_rank * chunk, (self.sp_rank + 1) * chunk
        for key, value in full.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == s:
                value = value[..., lo:hi].contiguous()
            if isinstance(value, torch.Tensor) and self.device is not None:
                value = value.to(self.device)
            out[key] = value
        return out
