"""The training data loader ``dscore.initialize(training_data=...)`` builds.

Like DeepSpeed's ``DeepSpeedDataLoader`` (``deepspeed/runtime/dataloader.py``): a
:class:`torch.utils.data.DistributedSampler` over the data-parallel group (``num_replicas`` = data-parallel
world size, ``rank`` = data-parallel rank, shuffled, seed 0), so ranks see disjoint shards; the batch size
is ``train_micro_batch_size_per_gpu``; ``collate_fn`` and ``dataloader_drop_last`` are honoured.

Differences, on purpose: every ``iter(loader)`` is one epoch and calls ``sampler.set_epoch(epoch)`` itself
(DeepSpeed leaves that to the user, so its shards repeat the same order each epoch unless they call it), and
the loader remembers its position so a checkpoint can resume mid-epoch without reading the skipped
samples:

* :meth:`DscoreDataLoader.state_dict` -> ``{"epoch": int, "batches_consumed": int}`` where ``epoch`` is the
  epoch in progress (or the next one when none is) and ``batches_consumed`` the batches already yielded in
  it. The engine exposes this as ``engine.data_sampler_state``.
* :meth:`DscoreDataLoader.load_state_dict` restores it: the next ``iter()`` continues epoch ``epoch`` at
  batch ``batches_consumed`` (the same samples, in the same order, as the uninterrupted run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from dscore.errors import ConfigError

__all__ = ["DscoreDataLoader", "RepeatingLoader"]


class _ResumableSampler(Sampler[int]):
    """Yields the indices of a :class:`DistributedSampler` for one epoch, starting at ``start`` (in samples)."""

    def __init__(self, inner: DistributedSampler[Any]) -> None:
        self.inner = inner
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(iter(self.inner))
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.start)


class DscoreDataLoader:
    """An epoch-aware, resumable loader over one rank's shard of ``dataset``.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch (``train_micro_batch_size_per_gpu``), > 0.
        dp_world_size / dp_rank: the data-parallel group size and this rank in it.
        collate_fn: merges a list of samples into a batch (torch's default when None).
        drop_last: drop the last incomplete batch (``dataloader_drop_last``); the sampler also pads or
            drops so every rank yields the same number of batches.
        pin_memory: pin host batches (useful when the accelerator is not the CPU).
        num_workers: worker processes (0 = load in the training process).
        seed: the sampler's shuffle seed (DeepSpeed: 0).

    Length: ``ceil(len(shard) / batch_size)`` (floor with ``drop_last``), like DeepSpeed.

    Raises:
        ConfigError: ``batch_size`` is not positive or the dataset has no length.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        dp_world_size: int,
        dp_rank: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        if batch_size <= 0:
            raise ConfigError(
                f"train_micro_batch_size_per_gpu must be > 0 to build the training data loader, got {batch_size}",
                path="train_micro_batch_size_per_gpu",
            )
        if not hasattr(dataset, "__len__"):
            raise ConfigError(
                "training_data must be a map-style dataset with __len__ and __getitem__ "
                f"(got {type(dataset).__name__}); iterable datasets cannot be sharded by a DistributedSampler"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=True, seed=seed, drop_last=drop_last
        )
        self._resumable = _ResumableSampler(self.sampler)
        self._loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self._resumable,
            collate_fn=collate_fn,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            # A private generator: starting an epoch (iter()) must not draw from the global torch RNG, or a
            # resumed run (which starts one more iterator) would see different dropout masks afterwards.
            generator=torch.Generator().manual_seed(seed),
        )
        self.drop_last = drop_last
        self.epoch = 0
        self.batches_consumed = 0
        self._resume_at = 0

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        # A previous epoch iterated to the end moves to the next; a partly consumed one (resume) continues.
        self.sampler.set_epoch(self.epoch)
        self._resumable.start = self._resume_at * self.batch_size
        self.batches_consumed = self._resume_at
        self._resume_at = 0
        return self._generate()

    def _generate(self) -> Iterator[Any]:
        for batch in self._loader:
            self.batches_consumed += 1
            yield batch
        self.epoch += 1
        self.batches_consumed = 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches_consumed"}``: where the next batch comes from (see the module docstring)."""
        return {"epoch": int(self.epoch), "batches_consumed": int(self.batches_consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state["epoch"]``, batch ``state["batches_consumed"]`` on the next ``iter()``.

        Raises:
            ConfigError: the state is missing a key or holds negative numbers.
        """
        try:
            epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"invalid data sampler state {state!r}: expected epoch and batches_consumed") from exc
        if epoch < 0 or consumed < 0:
            raise ConfigError(f"invalid data sampler state {state!r}: values must be >= 0")
        self.epoch = epoch
        self.batches_consumed = consumed
        self._resume_at = consumed


class RepeatingLoader:
    """An endless iterator over a finite iterable (DeepSpeed's ``RepeatingLoader``): when ``loader`` is
    exhausted it is iterated again from the start (a :class:`DscoreDataLoader` then starts its next epoch),
    so ``next()`` never raises ``StopIteration``. An empty ``loader`` raises ``StopIteration`` (nothing to
    repeat).

    Args:
        loader: any re-iterable (``torch.utils.data.DataLoader``, :class:`DscoreDataLoader`, a list).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # empty loader: StopIteration propagates
