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
    "EMULABLE_OPS",
    "Comm",
    "DistributedEnv",
    "RankFailure",
    "Work",
    "active_comm",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "configure",
    "discover_env",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "log_summary",
    "new_group",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_tensor",
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
    **{
        name: "dscore.comm.api"
        for name in (
            "active_comm", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
            "get_local_rank", "get_rank", "get_world_size", "is_initialized", "new_group", "reduce_scatter",
            "reduce_scatter_tensor",
        )
    },
}

if TYPE_CHECKING:  # pragma: no cover
    from dscore.comm.api import (
        active_comm,
        all_gather,
        all_gather_into_tensor,
        all_reduce,
        barrier,
        broadcast,
        get_local_rank,
        get_rank,
        get_world_size,
        is_initialized,
        new_group,
        reduce_scatter,
        reduce_scatter_tensor,
    )
    from dscore.comm.comms_logger import configure, log_summary
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
