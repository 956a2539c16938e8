"""Ulysses data and loss helpers: the sequence-sharding data loader adapter and a differentiable all-gather
(see :mod:`dscore_plugins.parallel.ulysses.attention` for the design)."""

from __future__ import annotations

import logging
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


class UlyssesSPDataLoaderAdapter:
    """Iterate ``dl`` yielding this rank's sequence shard of every batch (DeepSpeed's class of the same name).

    Each batch is a dict with ``input_ids`` ``[b, S]`` and optionally ``labels``, ``position_ids``,
    ``attention_mask`` and other ``[b, S]`` tensors. Labels are shifted on the full sequence first
    (``shift_labels[:, i] = labels[:, i + 1]``, ``-100`` at the end) so no target crosses a shard boundary;
    the yielded dict holds ``shift_labels`` instead of ``labels``, ``position_ids`` of the global sequence
    (created as ``arange(S)`` when missing), and no ``attention_mask`` (attention is causal by position;
    a mask with padding, any 0, is logged as a warning once per process: padded tokens are attended to).

    Stricter than DeepSpeed, which all-gathers the different batches the ranks of a group received and
    yields ``sp`` shards per batch: dscore requires every rank of the group to receive the same batch
    (the engine's loader shards over data-parallel ranks only) and checks it on the first batch.

    Raises (while iterating):
        ConfigError: ``S`` not divisible by ``sp_world_size`` (pad the batch to a multiple).
        DscoreError: the ranks of the group received different first batches.
    """

    def __init__(self, dl: Iterable[Any], sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.comm, self.sp = dl, int(sp_rank), as_comm(sp_group), int(sp_world_size)
        if self.comm is not None and int(self.comm.world_size) != self.sp:
            raise ConfigError(
                f"UlyssesSPDataLoaderAdapter: sp_world_size {self.sp} but the group has {self.comm.world_size} ranks",
                path="sequence_parallel_size",
            )
        self.device = torch.device(device) if device is not None else None
        self._checked = False

    def __len__(self) -> int:
        return len(self.dl)  # type: ignore[arg-type]

    def _check_same(self, batch: dict[str, Any]) -> None:
        if self.comm is None or self.sp == 1:
            return
        ids = batch["input_ids"]
        mine = torch.stack(
            [
                ids.double().sum(),
                (ids.double().flatten() * torch.arange(ids.numel(), device=ids.device)).sum(),
                torch.tensor(float(ids.numel()), dtype=torch.float64, device=ids.device),
            ]
        ).to(collective_device([ids], device=self.device))  # a loader's batch is on the host; NCCL needs the device

        outs = [torch.empty_like(mine) for _ in range(self.sp)]
        self.comm.all_gather(outs, mine)
        if not all(torch.equal(outs[0], o) for o in outs[1:]):
            raise DscoreError(
                "the ranks of a sequence-parallel group received different batches; every rank of the group must "
                "get the same batch (shard the data over data-parallel ranks only, as engine.training_dataloader does)"
            )

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

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dl:
            if not self._checked:
                self._check_same(batch)
                self._checked = True
            yield self.shard(batch)
