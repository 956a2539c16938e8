"""``deepspeed.comm`` on :mod:`dscore.comm`: the module-level collectives over the current runtime's
:class:`dscore.comm.Comm` (or torch.distributed's default group outside an engine)."""

from __future__ import annotations

from typing import Any

from dscore.comm import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    configure,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    log_summary,
    new_group,
    reduce_scatter,
    reduce_scatter_tensor,
)

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "configure",
    "destroy_process_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "log_summary",
    "new_group",
    "reduce_scatter",
    "reduce_scatter_tensor",
]


def is_available() -> bool:
    """True: dscore's comm layer is importable (DeepSpeed's ``comm.is_available``)."""
    return True


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` in ``group`` (``torch.distributed.get_global_rank``)."""
    import torch.distributed as dist

    if group is None:
        return int(group_rank)
    return int(dist.get_global_rank(group, group_rank))


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (the default group when None) if torch.distributed is initialized
    (``torch.distributed.destroy_process_group``; DeepSpeed's test harness calls it after each test)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)


def __getattr__(name: str) -> Any:
    if name == "ReduceOp":
        import torch.distributed as dist

        return dist.ReduceOp
    raise AttributeError(
        f"deepspeed.comm.{name} is not provided by dscore's compatibility layer; it offers {', '.join(__all__)}"
    )
