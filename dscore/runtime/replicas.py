"""Make a model's replicas equal before a ZeRO stage takes it over: rank 0's parameters and buffers.

Every engine builds its ZeRO stage through :func:`dscore.runtime.assembly.build_zero_stage`, which calls
:func:`broadcast_replicas` over the group the stage reduces gradients over (the sequence x data ranks of
the mesh for the standard engine, a pipeline stage's data-parallel group for the pipeline engine). A
stage assumes the ranks of that group hold the same model: stage 0 all-reduces gradients of replicas,
stages 1-2 copy each rank's slice into fp32 masters and all-gather them after the step, stage 3
partitions at construction. Without this, a rank-dependent seed before building the model trains
different models (stage 0), a mix of the ranks' initial slices (1-2), or gathers other values per rank (3).

DeepSpeed 0.19.8 (``DeepSpeedEngine._broadcast_model``, restated): after the model is placed and cast,
every parameter (frozen ones too) is broadcast from the first rank of the sequence-data-parallel group;
an MoE expert parameter (``allreduce = False``, ``group_name = "ep_size_<E>"``) from the first rank of its
expert-data-parallel group instead; parameters already partitioned by ``zero.Init`` are skipped (``Init``
broadcast them from rank 0 as it partitioned them). Tensor-parallel shards are never broadcast across
tensor ranks, because the group excludes them. DeepSpeed has no switch to turn it off.

dscore differs in two ways, both documented choices:

* buffers (persistent and non-persistent) are broadcast too, so running statistics and any buffer
  initialised from a rank-dependent generator are rank 0's as well (DeepSpeed leaves buffers as each rank
  built them). A buffer of a module whose parameters are all expert parameters of one group follows
  that group, like its parameters.
* the tensors are packed, as raw bytes, into flat buffers on the accelerator's device (at most
  ``bucket_bytes`` each; a tensor larger than that travels alone, in place when it is contiguous on the
  device), so the whole model costs one broadcast of its bytes in a few calls instead of one call per
  tensor; host tensors are staged through the device buffer, so the collective only sees device tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dscore.moe.groups import expert_groups
from dscore.moe.utils import is_moe_param
from dscore.zero.partition import unit_of

__all__ = ["DEFAULT_BUCKET_BYTES", "BroadcastSummary", "broadcast_replicas", "replica_groups"]

log = logging.getLogger("dscore.runtime.replicas")

#: upper bound of one packed buffer (transient device memory during ``initialize``)
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# start of every tensor in a packed buffer: a multiple of the largest element size, so a byte slice views
# back as the tensor's dtype (``Tensor.view(dtype)`` needs an aligned storage offset)
_ALIGN = 16


@dataclass(frozen=True)
class BroadcastSummary:
    """What :func:`broadcast_replicas` moved on this rank.

    Attributes:
        tensors: parameters and buffers broadcast (in groups of more than one rank).
        nbytes: their bytes (a rank receives, or rank 0 of each group sends, this much).
        calls: broadcast collectives issued.
        skipped_partitioned: parameters left alone because ``zero.Init`` already partitioned them.
        seconds: wall time of the whole call (packing, collectives, unpacking).
    """

    tensors: int
    nbytes: int
    calls: int
    skipped_partitioned: int
    seconds: float


def _expert_name(p: torch.Tensor) -> str | None:
    return str(p.group_name) if is_moe_param(p) else None  # type: ignore[attr-defined]


def replica_groups(module: torch.nn.Module) -> tuple[dict[str | None, list[torch.Tensor]], int]:
    """The tensors of ``module`` to make equal, keyed by the replica group they are equal over.

    Key ``None``: replicated over the whole data-parallel group; ``"ep_size_<E>"``: expert parameters (and
    the buffers of modules holding only such parameters), equal over their expert-data-parallel group.
    Tied parameters and shared buffers appear once, in registration order (every rank lists the same
    tensors in the same order, which the collectives rely on).

    Returns:
        ``(groups, skipped)``: ``skipped`` counts parameters already partitioned by ``zero.Init``.
    """
    groups: dict[str | None, list[torch.Tensor]] = {}
    seen: set[int] = set()
    skipped = 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if unit_of(p) is not None:
            skipped += 1
            continue
        groups.setdefault(_expert_name(p), []).append(p)
    for m in module.modules():
        own = [b for b in m.buffers(recurse=False) if b is not None and id(b) not in seen]
        if not own:
            continue
        names = {_expert_name(p) for p in m.parameters()}
        key = names.pop() if len(names) == 1 else None
        for b in own:
            seen.add(id(b))
            groups.setdefault(key, []).append(b)
    return groups, skipped


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[tuple[torch.Tensor, int]]]:
    """Consecutive runs of ``tensors`` with their aligned byte offsets, each at most ``bucket_bytes``
    (a larger tensor forms a bucket of its own)."""
    bucket: list[tuple[torch.Tensor, int]] = []
    end = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        start = -(-end // _ALIGN) * _ALIGN
        if bucket and start + n > bucket_bytes:
            yield bucket
            bucket, start = [], 0
        bucket.append((t, start))
        end = start + n
    if bucket:
        yield bucket


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@torch.no_grad()
def _broadcast_group(tensors: list[torch.Tensor], comm: Any, device: torch.device, bucket_bytes: int) -> int:
    """Rank 0 of ``comm``'s tensors into every rank's, bucket by bucket; returns the collectives issued."""
    src = comm.global_rank(0)
    is_src = int(comm.get_rank()) == 0
    calls = 0
    for bucket in _buckets(tensors, bucket_bytes):
        if len(bucket) == 1:
            t = bucket[0][0]
            if t.device == device and t.is_contiguous():
                comm.broadcast(_bytes_of(t), src)  # in place: no staging copy
                calls += 1
                continue
        last, off = bucket[-1]
        flat = torch.empty(off + last.numel() * last.element_size(), dtype=torch.uint8, device=device)
        if is_src:
            for t, o in bucket:
                n = t.numel() * t.element_size()
                flat[o : o + n].copy_(_bytes_of(t))
        comm.broadcast(flat, src)
        calls += 1
        if not is_src:
            for t, o in bucket:
                n = t.numel() * t.element_size()
                t.copy_(flat[o : o + n].view(t.dtype).view(t.shape))
        del flat
    return calls


def broadcast_replicas(
    module: torch.nn.Module,
    comm: Any,
    *,
    device: torch.device,
    mesh: Any = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> BroadcastSummary:
    """Overwrite every rank's parameters and buffers with rank 0's of their replica group (collective).

    Args:
        module: the placed and cast model (the one the ZeRO stage is about to take over). Parameters
            partitioned by ``dscore.zero.Init`` are skipped (their partitions were cut from rank 0's values).
        comm: the :class:`dscore.comm.Comm` of the data-parallel group the stage reduces over. A group of
            one rank costs nothing.
        device: the accelerator device the packed buffers are allocated on (the collective's device).
        mesh: the run's :class:`dscore.parallel.mesh.ParallelMesh` when ``comm`` is one of its groups: MoE
            expert groups are then the mesh's (:func:`dscore.moe.groups.expert_groups`).
        bucket_bytes: upper bound of one packed buffer, in bytes (> 0).

    Returns:
        a :class:`BroadcastSummary` (also logged at INFO on rank 0).

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
        ConfigError: an expert group's ``ep_size`` does not divide the data-parallel size (from
            :func:`dscore.moe.groups.expert_groups`).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes}")
    started = time.perf_counter()
    groups, skipped = replica_groups(module)
    tensors = nbytes = calls = 0
    for key in sorted(groups, key=lambda k: (k is not None, k or "")):  # the same order on every rank
        if key is None:
            group_comm = comm
        else:
            group_comm = expert_groups(comm, int(key.rsplit("_", 1)[1]), mesh=mesh).edp_comm
        if int(group_comm.get_world_size()) <= 1:
            continue
        members = groups[key]
        calls += _broadcast_group(members, group_comm, device, bucket_bytes)
        tensors += len(members)
        nbytes += sum(t.numel() * t.element_size() for t in members)
    summary = BroadcastSummary(tensors, nbytes, calls, skipped, time.perf_counter() - started)
    if calls and int(comm.get_rank()) == 0:
        log.info(
            "replicas made equal: %d parameter/buffer tensor(s), %.1f MiB from rank 0 of each data-parallel "
            "group in %d broadcast(s), %.3f s (%d zero.Init-partitioned parameter(s) already rank 0's)",
            summary.tensors,
            summary.nbytes / 2**20,
            summary.calls,
            summary.seconds,
            summary.skipped_partitioned,
        )
    return summary
