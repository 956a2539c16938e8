"""Collective arrival guard: fail fast, with a name, when not every rank calls a collective engine API.

Every API that all ranks must call (``initialize``, ``save_checkpoint``, ``load_checkpoint``,
``save_16bit_model``, entering ``GatheredParameters`` on partitioned parameters, ...) first calls
:func:`ensure_all_arrived` with its name. When a rank does not arrive within the *arrival timeout*, every
rank that did arrive raises :class:`CollectiveArrivalError` naming the method and the ranks that did not
arrive, instead of blocking in the collective until the 10-minute process-group timeout and then raising a
backend error that names no dscore method (the plain-PyTorch habit of ``if rank == 0:
engine.save_checkpoint(...)`` is the usual cause). DeepSpeed has no such check: its ranks hang.

The arrival timeout (seconds) is ``DSCORE_ARRIVAL_TIMEOUT`` (default :data:`DEFAULT_ARRIVAL_TIMEOUT_S`,
120 s; ``0`` turns the guard off), or the ``timeout=`` argument. It bounds how far apart ranks may reach the
same call, not how long the call's own work may take.

How it works (one rendezvous through the default group's key-value store, so it is the same on gloo,
nccl and every other backend, and costs three small store round trips on the fast path): each call of
``method`` on a rank gets the next sequence number ``s`` of that method; the rank appends its rank to the
``who`` key of ``(method, s)`` and increments its ``count`` key. The rank that brings the count to the
world size sets ``done``; the others wait for ``done``. A rank whose wait times out *abandons* the call by
adding a large constant to ``count``: the first to abandon records the verdict (every rank had arrived
after all, or not), so that all ranks decide alike; a rank arriving after the call was abandoned raises at
once. Keys of the previous call of the same method are deleted by the last arriver.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dscore.errors import DistributedError

__all__ = [
    "ARRIVAL_TIMEOUT_ENV",
    "DEFAULT_ARRIVAL_TIMEOUT_S",
    "CollectiveArrivalError",
    "arrival_timeout",
    "ensure_all_arrived",
]

log = logging.getLogger("dscore.comm")

#: environment variable holding the arrival timeout in seconds (``0``: no guard).
ARRIVAL_TIMEOUT_ENV = "DSCORE_ARRIVAL_TIMEOUT"
#: default arrival timeout, seconds.
DEFAULT_ARRIVAL_TIMEOUT_S = 120.0

_ABANDONED = 1 << 40  # added to a call's count by the first rank that stops waiting
_VERDICT_WAIT_S = 30.0  # how long a second abandoning rank waits for the first one's verdict
_PREFIX = "dscore/arrival"

_lock = threading.Lock()
_sequence: dict[str, int] = {}


class CollectiveArrivalError(DistributedError):
    """Not every rank called a collective API within the arrival timeout.

    Attributes:
        method: the API (``"save_checkpoint"``).
        missing: global ranks that did not arrive (sorted).
        arrived: global ranks that did.
        timeout: the arrival timeout in seconds.
    """

    def __init__(self, message: str, *, method: str, missing: list[int], arrived: list[int], timeout: float) -> None:
        super().__init__(message)
        self.method = method
        self.missing = missing
        self.arrived = arrived
        self.timeout = timeout


def arrival_timeout(environ: Mapping[str, str] | None = None) -> float:
    """The arrival timeout in seconds: ``DSCORE_ARRIVAL_TIMEOUT``, else 120; ``0`` means no guard.

    Raises:
        DistributedError: the variable is not a number >= 0.
    """
    env = os.environ if environ is None else environ
    text = env.get(ARRIVAL_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_ARRIVAL_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise DistributedError(
            f"{ARRIVAL_TIMEOUT_ENV}={text!r} must be a number of seconds >= 0 (0 turns the arrival guard off; "
            f"default {DEFAULT_ARRIVAL_TIMEOUT_S:g})"
        )
    return value


def _default_store() -> Any:
    # the default group's rendezvous store (a PrefixStore over the TCPStore/FileStore torch created);
    # torch exposes it only under this name
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def _next_sequence(method: str) -> int:
    with _lock:
        seq = _sequence.get(method, 0) + 1
        _sequence[method] = seq
        return seq


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def _ranks(text: bytes) -> list[int]:
    return sorted({int(part) for part in text.decode().split(",") if part.strip()})


def ensure_all_arrived(method: str, *, timeout: float | None = None, group: Any = None) -> None:
    """Return once every rank of ``group`` has called ``method`` as often as this rank has.

    A no-op without a default process group, with one rank, or with a timeout of 0. Collective: every rank
    must call it for every call of ``method`` (the engine APIs do it for you).

    Args:
        method: the API's name, used in keys and in the error (``"save_checkpoint"``).
        timeout: seconds to wait for the other ranks; default :func:`arrival_timeout`.
        group: the process group whose ranks must all call ``method`` (default: the default group). Ranks
            in errors are global ranks.

    Raises:
        CollectiveArrivalError: some rank did not arrive within ``timeout`` seconds (raised on every rank
            that arrived, naming the missing ranks), or this rank arrived after the others stopped waiting.
        DistributedError: ``DSCORE_ARRIVAL_TIMEOUT`` is malformed.
    """
    limit = arrival_timeout() if timeout is None else float(timeout)
    if limit <= 0 or not (dist.is_available() and dist.is_initialized()):
        return
    rank = dist.get_rank()
    if group is None:
        members = list(range(dist.get_world_size()))
        scope = method
    else:
        members = sorted(int(r) for r in dist.get_process_group_ranks(group))
        digest = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:12]
        scope = f"{method}@{digest}"
    world = len(members)
    if world <= 1 or rank not in members:
        return
    store = _default_store()
    if store is None:
        log.debug("no rendezvous store for the default group; %s runs without the arrival guard", method)
        return
    seq = _next_sequence(scope)
    key = f"{_PREFIX}/{scope}/{seq}"
    store.append(f"{key}/who", f"{rank},")
    count = int(store.add(f"{key}/count", 1))
    if count >= _ABANDONED:
        others = [r for r in _ranks(store.get(f"{key}/who")) if r != rank]
        raise CollectiveArrivalError(
            f"rank {rank} called {method} after rank(s) {others} had stopped waiting for it "
            f"({ARRIVAL_TIMEOUT_ENV}={limit:g} s): every rank must call {method} at the same point of the program",
            method=method, missing=[], arrived=others, timeout=limit,
        )
    if count == world:
        store.set(f"{key}/done", "1")
        if seq > 1:
            old = f"{_PREFIX}/{scope}/{seq - 1}"
            for suffix in ("who", "count", "done", "verdict"):
                store.delete_key(f"{old}/{suffix}")
        return
    try:
        store.wait([f"{key}/done"], timedelta(seconds=limit))
        return
    except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError on timeout
        if not _is_timeout(exc):
            raise DistributedError(
                f"{method}: lost the rendezvous store while waiting for the other ranks to call {method} "
                f"(rank 0 hosts it: it has probably exited or failed without calling {method}): {exc}"
            ) from exc
    total = int(store.add(f"{key}/count", _ABANDONED))
    if total // _ABANDONED == 1:  # first to give up: decide for everyone
        all_in = total % _ABANDONED == world
        store.set(f"{key}/verdict", "ok" if all_in else "fail")
    else:
        store.wait([f"{key}/verdict"], timedelta(seconds=_VERDICT_WAIT_S))
        all_in = store.get(f"{key}/verdict") == b"ok"
    if all_in:
        return
    arrived = _ranks(store.get(f"{key}/who"))
    missing = sorted(set(members) - set(arrived))
    raise CollectiveArrivalError(
        f"{method} must be called by every rank, but rank(s) {missing} of {world} did not call it within "
        f"{limit:g} s (rank(s) {arrived} did; this is call #{seq} of {method} on rank {rank}). Call {method} "
        f"on every rank (not only on rank 0); if ranks legitimately reach it far apart, raise "
        f"{ARRIVAL_TIMEOUT_ENV} (seconds, 0 = no check).",
        method=method, missing=missing, arrived=arrived, timeout=limit,
    )

