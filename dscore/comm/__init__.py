"""Distributed communication: ``init_distributed``, environment discovery and the :class:`Comm` facade.

:class:`Comm` is the one collective layer of dscore (async :class:`Work` handles, one-rank short cuts,
the gloo fast paths, :meth:`Comm.agree`); ``bound_to(group)`` gives one over a sub-group.

The facade is owned by the runtime (``dscore.runtime.context.current_runtime().comm``), not kept in a
module global. The module-level functions below are conveniences for user code written against
``deepspeed.comm``: each one uses the current runtime's facade, or, outside ``dscore.initialize``, a
facade over torch.distributed's default group (created by :func:`init_distributed` or by the user).

``import dscore.comm`` and :mod:`dscore.comm.env` are torch-free; the facade, ``init_distributed`` and the
module-level collectives import torch on first access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from dscore.comm.env import DistributedEnv, discover_env

__all__ = [
    "Comm",
    "DistributedEnv",
    "EMULABLE_OPS",
    "RankFailure",
    "Work",
    "active_comm",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object",
    "configure",
    "discover_env",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_comm_operation_count",
    "get_local_rank",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_size",
    "has_comm_data",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "send",
]

# name -> module holding it; these import torch, so they load on first access
_LAZY: dict[str, str] = {
    "Comm": "dscore.comm.facade",
    "EMULABLE_OPS": "dscore.comm.facade",
    "reduce_op": "dscore.comm.facade",
    "RankFailure": "dscore.comm.facade",
    "Work": "dscore.comm.facade",
    "init_distributed": "dscore.comm.init",
    "configure": "dscore.comm.comms_logger",
    "log_summary": "dscore.comm.comms_logger",
    **{name: "dscore.comm.comms_logger" for name in ("get_comm_operation_count", "get_logged_comm_ops", "has_comm_data",
                                                      "reset_log")},
    **{
        name: "dscore.comm.api"
        for name in (
            "active_comm", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
            "get_local_rank", "get_rank", "get_world_size", "is_initialized", "new_group", "reduce_scatter",
            "reduce_scatter_tensor", *('all_gather_coalesced', 'all_gather_object', 'all_reduce_coalesced', 'all_to_all', 'all_to_all_single', 'batch_isend_irecv', 'broadcast_object', 'gather', 'get_all_ranks_from_group', 'get_backend', 'irecv', 'isend', 'monitored_barrier', 'recv', 'reduce', 'scatter', 'send'),
        )
    },
}

if TYPE_CHECKING:  # pragma: no cover
    from dscore.comm.api import (
        active_comm,
        all_gather,
        all_gather_coalesced,
        all_gather_into_tensor,
        all_gather_object,
        all_reduce,
        all_reduce_coalesced,
        all_to_all,
        all_to_all_single,
        barrier,
        batch_isend_irecv,
        broadcast,
        broadcast_object,
        gather,
        get_all_ranks_from_group,
        get_backend,
        get_local_rank,
        get_rank,
        get_world_size,
        irecv,
        is_initialized,
        isend,
        monitored_barrier,
        new_group,
        recv,
        reduce,
        reduce_scatter,
        reduce_scatter_tensor,
        scatter,
        send,
    )
    from dscore.comm.comms_logger import (
        configure,
        get_comm_operation_count,
        get_logged_comm_ops,
        has_comm_data,
        log_summary,
        reset_log,
    )
    from dscore.comm.facade import EMULABLE_OPS, Comm, RankFailure, Work, reduce_op
    from dscore.comm.init import init_distributed


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dscore.comm' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
