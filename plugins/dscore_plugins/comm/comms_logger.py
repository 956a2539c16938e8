"""The communication logger: count, size, latency and bandwidth of every collective (``comms_logger``).

DeepSpeed 0.19.8's ``deepspeed.utils.comms_logging`` semantics, recorded at the entry of each
collective of :class:`dscore.comm.Comm` (importing this module registers its recording wrapper through the
facade's hook point, :func:`dscore.comm.instrument.wrap_collectives`; the user-facing names
``dscore.comm.configure`` / ``log_summary`` and :mod:`dscore.comm.comms_logger` resolve here through the
``comms_logger`` config-section unit of the comm plugin):

* a record is kept per operation name (``all_reduce``, ``all_gather_into_tensor``, ...; with ``debug``
  the name gets ``" | [Caller Func: <function>]"``) and message size, holding the count and, per call,
  the latency (ms), algorithmic and bus bandwidth (Gbps);
* an operation is recorded when ``enabled`` and (``prof_all`` or its name is in ``prof_ops``);
  ``verbose`` logs every recorded call on rank 0;
* the message size is DeepSpeed's: the bytes of the tensor argument (``tensor`` / ``input``; the sum of
  ``input_list``; 0 for ``barrier``);
* bandwidth (nccl-tests' definitions, as DeepSpeed): with ``n`` the size of the group the collective ran
  on, ``all_reduce`` / ``all_reduce_coalesced``: algbw = 2·size/t, busbw = size/t · 2(n-1)/n; ``all_gather*``: size·n/t and
  size·n/t · (n-1)/n; ``reduce_scatter*`` and ``all_to_all*``: size/t and size/t · (n-1)/n (size is the whole input; DeepSpeed
  multiplies it by n once more, over-stating reduce-scatter bandwidth n times, and uses the global world
  size for sub-group collectives: dscore does neither); ``broadcast``, ``reduce``, ``gather``, ``scatter``,
  ``send``/``recv``/``isend``/``irecv``/``batch_isend_irecv``, ``barrier``/``monitored_barrier``: size/t for both. Bytes/ms · 8 / 1e6 = Gbps;
* a recorded collective is made blocking (its work is waited for and the device synchronized before the
  clock stops), as DeepSpeed's; ``isend``/``irecv`` are timed to their launch only (waiting there could
  deadlock a send/receive pair);
* :meth:`CommsLogger.log_all` prints DeepSpeed's table with averages trimmed of the top and bottom 10%.

Calls nested inside a recorded collective (an emulation running another collective) are not recorded
again. The record is per process, like torch.distributed's default group: :func:`get_comms_logger`.
This module is torch-free at import.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, TextIO

from dscore.comm.instrument import COLLECTIVES, wrap_collectives

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

log = logging.getLogger("dscore.comm.comms_logger")

#: Operation names the logger records (``prof_ops`` takes these): every instrumentable collective.
LOGGED_OPS: frozenset[str] = COLLECTIVES

_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced"}
_GATHER = {"all_gather", "all_gather_into_tensor", "all_gather_coalesced"}
_SCATTER = {"reduce_scatter", "reduce_scatter_tensor"}
_ALL_TO_ALL = {"all_to_all_single", "all_to_all"}
_POINT = {"broadcast", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "reduce",
          "gather", "scatter"}
_NO_WAIT = {"isend", "irecv"}


def convert_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024, two decimals; ``"0B"`` for 0), DeepSpeed's format."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def calc_bw_log(op: str, size: int, duration_ms: float, world: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbps of ``op`` moving ``size`` bytes (DeepSpeed's message size) in
    ``duration_ms`` over ``world`` ranks (formulas in the module docstring).

    Raises:
        ValueError: ``op`` is not one of :data:`LOGGED_OPS`.
    """
    if op not in LOGGED_OPS:
        raise ValueError(f"comms logger: unknown operation {op!r}; known: {sorted(LOGGED_OPS)}")
    if duration_ms <= 0:
        return 0.0, 0.0
    n = max(1, int(world))
    rate = size / duration_ms
    if op in _ALL_REDUCE:
        algbw, busbw = 2 * rate, rate * 2 * (n - 1) / n
    elif op in _GATHER:
        algbw = rate * n
        busbw = algbw * (n - 1) / n
    elif op in _SCATTER or op in _ALL_TO_ALL:
        algbw, busbw = rate, rate * (n - 1) / n
    else:
        algbw = busbw = rate
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(data: Iterable[float], trim_percent: float) -> float:
    """Mean after dropping ``round(n * trim_percent)`` values at each end (0 for no data)."""
    values = sorted(data)
    n = len(values)
    if n == 0:
        return 0.0
    k = int(round(n * trim_percent))
    kept = values[k : n - k]
    return sum(kept) / len(kept) if kept else 0.0


class CommsLogger:
    """Per-process record of collectives (see the module docstring for what is recorded).

    Attributes:
        enabled, verbose, prof_all, prof_ops, debug: the ``comms_logger`` keys (DeepSpeed defaults).
        comms_dict: ``{record_name: {msg_size: [count, [latency ms], [algbw Gbps], [busbw Gbps]]}}``.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.debug = False
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def configure(
        self,
        enabled: bool | None = None,
        prof_all: bool | None = None,
        prof_ops: Iterable[str] | None = None,
        verbose: bool | None = None,
        debug: bool | None = None,
    ) -> None:
        """Set the keys given (None leaves one as it is).

        Raises:
            ValueError: ``prof_ops`` names an operation the logger does not know.
        """
        if prof_ops is not None:
            ops = list(prof_ops)
            unknown = sorted(set(ops) - LOGGED_OPS)
            if unknown:
                raise ValueError(f"comms_logger.prof_ops: unknown operation(s) {unknown}; known: {sorted(LOGGED_OPS)}")
            self.prof_ops = ops
        if enabled is not None:
            self.enabled = bool(enabled)
        if prof_all is not None:
            self.prof_all = bool(prof_all)
        if verbose is not None:
            self.verbose = bool(verbose)
        if debug is not None:
            self.debug = bool(debug)

    def start_profiling_comms(self) -> None:
        """Record every operation (``prof_all = True``)."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Record only ``prof_ops`` (``prof_all = False``)."""
        self.prof_all = False

    def start_profiling_op(self, op_names: Iterable[str]) -> None:
        """Add operations to ``prof_ops``."""
        self.configure(prof_ops=sorted(set(self.prof_ops) | set(op_names)))

    def stop_profiling_op(self, op_names: Iterable[str]) -> None:
        """Remove operations from ``prof_ops``."""
        drop = set(op_names)
        self.prof_ops = [op for op in self.prof_ops if op not in drop]

    def wants(self, op: str) -> bool:
        """Whether a call of ``op`` is recorded now."""
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int, world: int) -> None:
        """Add one call of ``raw_name`` (recorded as ``record_name``) that took ``latency_ms``."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, world)
        with self._lock:
            sizes = self.comms_dict.setdefault(record_name, {})
            row = sizes.get(msg_size)
            if row is None:
                sizes[msg_size] = [1, [latency_ms], [algbw], [busbw]]
            else:
                row[0] += 1
                row[1].append(latency_ms)
                row[2].append(algbw)
                row[3].append(busbw)
        if self.verbose:
            log.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                record_name, latency_ms, convert_size(msg_size), algbw, busbw,
            )  # fmt: skip

    # ----------------------------------------------------------------- reading
    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """A copy of :attr:`comms_dict`."""
        with self._lock:
            return {
                k: {s: [v[0], list(v[1]), list(v[2]), list(v[3])] for s, v in d.items()}
                for k, d in self.comms_dict.items()
            }

    def has_data(self) -> bool:
        """Whether anything was recorded."""
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        """Forget every record."""
        with self._lock:
            self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        """Record names in the order first seen."""
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        """Calls recorded over every operation and size."""
        return sum(row[0] for sizes in self.comms_dict.values() for row in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """``{msg_size: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps,
        msg_size_bytes, msg_size_str}}`` of one record (averages trimmed 10%), or None."""
        sizes = self.get_raw_data().get(operation_name)
        if sizes is None:
            return None
        return {size: _summary(size, row) for size, row in sorted(sizes.items())}

    def log_all(
        self,
        print_log: bool = True,
        show_straggler: bool = False,
        return_dict: bool = False,
        *,
        min_latencies: dict[str, dict[int, list[float]]] | None = None,
        world_size: int = 1,
        rank: int = 0,
        stream: TextIO | None = None,
    ) -> dict[str, Any] | None:
        """Print DeepSpeed's table (to ``stream``, default standard output) and/or return the statistics.

        Args:
            show_straggler: add the straggler breakdown; needs ``min_latencies`` (each latency's minimum
                over the ranks, same layout as the latency lists), which :func:`dscore.comm.log_summary`
                computes collectively.
            return_dict: return ``{"summary": ..., "straggler_analysis": ... | None, "metadata": ...}``.

        Raises:
            ValueError: ``show_straggler`` without ``min_latencies``.
        """
        if show_straggler and min_latencies is None:
            raise ValueError(
                "log_all(show_straggler=True) needs the per-rank minimum latencies: use dscore.comm.log_summary"
            )
        data = self.get_raw_data()
        out = stream or sys.stdout
        lines: list[str] = []
        result: dict[str, Any] = {
            "summary": {},
            "straggler_analysis": None,
            "metadata": {"world_size": world_size, "rank": rank, "timestamp": datetime.now().isoformat()},
        }
        w = 20
        lines.append(
            f"{'Comm. Op': <{w}}{'Message Size': <{w}}{'Count': <{w}}{'Total Latency(ms)': <{w}}"
            f"{'Avg Latency(ms)': <{w}}{'tput_avg (Gbps)': <{w}}{'busbw_avg (Gbps)': <{w}}"
        )
        for name, sizes in data.items():
            lines.append(name)
            result["summary"][name] = {}
            for size, row in sorted(sizes.items()):
                s = _summary(size, row)
                result["summary"][name][size] = s
                lines.append(
                    f"{' ': <{w}}{s['msg_size_str']: <{w}}{s['count']: <{w}}{s['total_latency_ms']: <{w}.2f}"
                    f"{s['avg_latency_ms']: <{w}.2f}{s['tput_avg_gbps']: <{w}.2f}{s['busbw_avg_gbps']: <{w}.2f}"
                )
        if show_straggler and min_latencies is not None:
            result["straggler_analysis"] = {}
            lines += [
                "_______________________________",
                "Breakdown with straggler effect",
                "-------------------------------",
            ]
            lines.append(
                f"{'Comm. Op': <{w}}{'Message Size': <{w}}{'Count': <{w}}{'Total comm lat(ms)': <{w}}"
                f"{'Total straggler(ms)': <{w}}{'Avg comm lat(ms)': <{w}}{'Avg straggler(ms)': <{w}}"
            )
            for name, sizes in data.items():
                lines.append(name)
                result["straggler_analysis"][name] = {}
                for size, row in sorted(sizes.items()):
                    mins = min_latencies[name][size]
                    straggle = [a - b for a, b in zip(row[1], mins)]
                    entry = {
                        "count": row[0],
                        "total_comm_lat_ms": sum(mins),
                        "total_straggler_ms": sum(straggle),
                        "avg_comm_lat_ms": trim_mean(mins, 0.1),
                        "avg_straggler_ms": trim_mean(straggle, 0.1),
                        "msg_size_bytes": size,
                        "msg_size_str": convert_size(size),
                    }
                    result["straggler_analysis"][name][size] = entry
                    lines.append(
                        f"{' ': <{w}}{entry['msg_size_str']: <{w}}{row[0]: <{w}}{entry['total_comm_lat_ms']: <{w}.2f}"
                        f"{entry['total_straggler_ms']: <{w}.2f}{entry['avg_comm_lat_ms']: <{w}.2f}"
                        f"{entry['avg_straggler_ms']: <{w}.2f}"
                    )
        if print_log:
            out.write("\n".join(lines) + "\n")
            out.flush()
        return result if return_dict else None

    # ----------------------------------------------------------------- recording (used by instrument)
    def _depth(self) -> int:
        return int(getattr(self._local, "depth", 0))

    def _set_depth(self, value: int) -> None:
        self._local.depth = value


def _summary(size: int, row: list[Any]) -> dict[str, Any]:
    return {
        "count": row[0],
        "total_latency_ms": sum(row[1]),
        "avg_latency_ms": trim_mean(row[1], 0.1),
        "tput_avg_gbps": trim_mean(row[2], 0.1),
        "busbw_avg_gbps": trim_mean(row[3], 0.1),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


_LOGGER = CommsLogger()


def get_comms_logger() -> CommsLogger:
    """The process's :class:`CommsLogger` (collectives are process-wide, as the default process group)."""
    return _LOGGER


# --------------------------------------------------------------------------------------------- recording
def _bytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    if hasattr(value, "tensor") and hasattr(value, "peer"):  # a P2POp of batch_isend_irecv
        return _bytes(value.tensor)
    numel = getattr(value, "numel", None)
    size = getattr(value, "element_size", None)
    return int(numel()) * int(size()) if callable(numel) and callable(size) else 0


#: which argument holds DeepSpeed's message tensor, per operation (0 bytes when absent)
_MESSAGE_ARG = {
    "all_reduce": "tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter": "input_list",
    "all_gather_into_tensor": "input",
    "all_gather": "tensor",
    "broadcast": "tensor",
    "all_to_all_single": "tensor",
    "all_to_all": "input_tensor_list",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "all_reduce_coalesced": "tensors",
    "all_gather_coalesced": "input_tensors",
    "batch_isend_irecv": "p2p_ops",
    "monitored_barrier": "",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "barrier": "",
}


def _caller() -> str:
    """The first function outside this module and the facade that called the collective."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in (__file__, _FACADE_FILE[0]):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_code.co_name if frame is not None else "<unknown>"


_FACADE_FILE = [""]


def _synchronize() -> None:
    """Finish queued device work before reading the clock (the current runtime's accelerator; nothing
    outside a runtime, where collectives run on host tensors)."""
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    if runtime is not None:
        runtime.accelerator.synchronize()


def _recorded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The recording replacement of the facade's collective ``name`` (a
    :data:`dscore.comm.instrument.CollectiveWrapper`): one attribute test while the logger is off."""
    if getattr(method, "__comms_logged__", False):
        return method
    code = getattr(method, "__code__", None)
    if code is not None:
        _FACADE_FILE[0] = code.co_filename  # the facade's frames are not the caller
    signature = inspect.signature(method)
    message_arg = _MESSAGE_ARG[name]
    logger = _LOGGER

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not logger.enabled or logger._depth() or not logger.wants(name):
            return method(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        size = _bytes(bound.arguments.get(message_arg)) if message_arg else 0
        group = bound.arguments.get("group")
        record = f"{name} | [Caller Func: {_caller()}]" if logger.debug else name
        logger._set_depth(1)
        try:
            _synchronize()
            began = time.perf_counter()
            result = method(self, *args, **kwargs)
            if result is not None and name not in _NO_WAIT and hasattr(result, "wait"):
                result.wait()  # blocking while recorded, as DeepSpeed's synchronize
            _synchronize()
            elapsed_ms = (time.perf_counter() - began) * 1000.0
        finally:
            logger._set_depth(0)
        world = 1 if name in _POINT else int(self.get_world_size(group))
        logger.append(name, record, elapsed_ms, size, world)
        return result

    wrapper.__comms_logged__ = True  # type: ignore[attr-defined]
    return wrapper


wrap_collectives(_recorded)  # every facade's collectives, from now on


# --------------------------------------------------------------------------------------------- module API
def configure(
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: Iterable[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """``deepspeed.comm.configure``: set the process's comms-logger keys (None leaves one as it is).

    Raises:
        ValueError: ``prof_ops`` names an unknown operation.
    """
    _LOGGER.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """``deepspeed.comm.log_summary``: print the comms table on rank 0 (every rank of the job calls it).

    With a process group, the ranks meet at a barrier first (not recorded). ``show_straggler`` takes the
    minimum over ranks of each recorded latency (one all-reduce, not recorded) and adds DeepSpeed's
    straggler breakdown: every rank must have recorded the same operations, sizes and counts.

    Returns:
        The statistics dict of :meth:`CommsLogger.log_all` on every rank when ``return_dict``, else None.

    Raises:
        DistributedError: ``show_straggler`` while the ranks recorded different operations (names the ranks).
    """
    import torch

    from dscore.comm.api import active_comm, is_initialized
    from dscore.errors import DistributedError
    from dscore.runtime.context import peek_runtime

    comm = active_comm() if is_initialized() else None
    rank = comm.get_rank() if comm is not None else 0
    world = comm.get_world_size() if comm is not None else 1
    mins: dict[str, dict[int, list[float]]] | None = None
    _LOGGER._set_depth(1)  # the summary's own collectives are not recorded
    try:
        if comm is not None and world > 1:
            comm.barrier()
        data = _LOGGER.get_raw_data()
        if show_straggler:
            layout = [(name, size, row[0]) for name, sizes in data.items() for size, row in sorted(sizes.items())]
            mins = {name: {} for name in data}
            if comm is not None and world > 1:
                layouts = comm.all_gather_object(sorted(layout))
                differ = [r for r, other in enumerate(layouts) if other != layouts[0]]
                if differ:
                    raise DistributedError(
                        f"log_summary(show_straggler=True): ranks {differ} recorded other operations, sizes or "
                        "counts than rank 0; the straggler breakdown needs the same record on every rank"
                    )
                runtime = peek_runtime()
                device = runtime.accelerator.device() if runtime is not None else torch.device("cpu")
                flat = [lat for name, size, _ in layout for lat in data[name][size][1]]
                buf = torch.tensor(flat, dtype=torch.float64, device=device)
                comm.all_reduce(buf, op="min")
                values = buf.tolist()
            else:
                values = [lat for name, size, _ in layout for lat in data[name][size][1]]
            at = 0
            for name, size, count in layout:
                mins[name][size] = values[at : at + count]
                at += count
    finally:
        _LOGGER._set_depth(0)
    return _LOGGER.log_all(
        print_log=rank == 0, show_straggler=show_straggler, return_dict=return_dict, min_latencies=mins,
        world_size=world, rank=rank,
    )  # fmt: skip


def reset_log() -> None:
    """``deepspeed.comm.reset_log``: forget every record of the process's logger (per-epoch statistics)."""
    _LOGGER.reset_data()


def has_comm_data() -> bool:
    """``deepspeed.comm.has_comm_data``: whether the process's logger recorded anything."""
    return _LOGGER.has_data()


def get_comm_operation_count() -> int:
    """``deepspeed.comm.get_comm_operation_count``: calls recorded, over every operation and size."""
    return _LOGGER.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """``deepspeed.comm.get_logged_comm_ops``: the recorded operation names, in the order first seen."""
    return _LOGGER.get_operation_names()
