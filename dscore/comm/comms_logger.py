"""The communication logger's user-facing names (``comms_logger``), provided by the comm plugin.

The logger itself (count, size, latency and bandwidth of every collective of :class:`dscore.comm.Comm`,
DeepSpeed's table) lives in the comm plugin's ``comms_logger`` unit and attaches to the facade through
its public hook point (:mod:`dscore.comm.instrument`). The names below resolve, on first access, through
the registry (the current runtime's inside ``dscore.initialize``, else the installed plugins): a disabled
comm plugin raises the registry's error naming it. ``dscore.comm.configure`` and ``dscore.comm.log_summary``
are these, as are ``reset_log``, ``has_comm_data``, ``get_comm_operation_count`` and
``get_logged_comm_ops`` (DeepSpeed's accessors of the logged data).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dscore.exports import thin_getattr

__all__ = [
    "LOGGED_OPS",
    "CommsLogger",
    "calc_bw_log",
    "configure",
    "convert_size",
    "get_comm_operation_count",
    "get_comms_logger",
    "get_logged_comm_ops",
    "has_comm_data",
    "log_summary",
    "reset_log",
    "trim_mean",
]

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Iterable
    from typing import Any

    LOGGED_OPS: frozenset[str]
    CommsLogger: Any
    calc_bw_log: Callable[[str, int, float, int], tuple[float, float]]
    configure: Callable[..., None]
    convert_size: Callable[[int], str]
    get_comms_logger: Callable[[], Any]
    log_summary: Callable[..., dict[str, Any] | None]
    reset_log: Callable[[], None]
    has_comm_data: Callable[[], bool]
    get_comm_operation_count: Callable[[], int]
    get_logged_comm_ops: Callable[[], list[str]]
    trim_mean: Callable[[Iterable[float], float], float]

__getattr__ = thin_getattr(__name__, "config_section", "comms_logger", __all__)
