"""Weight sync from the training ranks to separate generation processes (RLHF; issue 40 item 4).

The model is vLLM's weight-update group: the generation process(es) are not in the training world; one training
rank and the receivers form a process group of their own over a ``TCPStore`` (:class:`WeightSyncGroup`; the
training world's default group is never touched). :class:`WeightSyncSender` streams
``engine.iter_full_params`` buckets (every training rank calls ``send``: the export is collective under ZeRO-3;
one rank sends), :class:`WeightSyncReceiver` loads them in place into a module or a dict of tensors.

**Wire format** (sync rank 0 sends, every frame a broadcast from it):

* a control frame: int64 ``[MAGIC, kind, a, b]`` on the host, then ``b`` bytes of UTF-8 JSON (uint8);
* ``HEADER`` (``a`` = step): ``{"step", "seq", "dtype"}``; ``BUCKET`` (``a`` = bucket index):
  ``{"packed_nbytes", "nbytes", "entries": [{"name", "shape", "dtype", "nbytes", "direct", "offset"}, ...]}``
  followed, once every receiver accepted the metadata, by the bucket's raw bytes (uint8) on the data device:
  one buffer of ``packed_nbytes`` holding every small tensor at its ``offset`` (16-byte aligned), then each
  ``direct`` tensor (256 KiB or more) as a message of its own, in entry order (a receiver whose target tensor
  is contiguous on the data device receives it straight into the target: no copy on either side);
  ``END`` (``a`` = step): ``{"count", "buckets", "bytes"}``;
  ``ABORT`` (``a`` = step): ``{"reason"}`` (the sender failed; receivers raise with the reason).
* after ``HEADER``, each ``BUCKET``'s metadata and ``END`` every member takes part in an int64 all-reduce (SUM)
  of one slot per member: a receiver puts 1 in its slot to reject (an unknown name, a shape or dtype mismatch, or
  at ``END`` a missing name or a wrong count; its reason goes to the store), so the sender stops before sending
  bytes nobody will load, and ``send`` returns only after every receiver loaded the step.

**Transport**: control frames and acknowledgements always go over gloo (host tensors). Bucket bytes go over the
data backend chosen by the group's ``device``: ``cpu`` -> the same gloo group, ``cuda`` -> an NCCL group on the
same store (device tensors; built, not tested on this repository's CPU-only CI: there, a peer dying while bucket
bytes are in flight is caught by NCCL's own timeout and watchdog, set to the group's ``timeout``, not by a closed
connection). A bucket's direct tensors stay in flight while the export builds the next bucket (the overlap
``bucket_bytes`` sets the grain of).

**Faults** (bounded, never a hang): a peer that dies closes its TCP connections, and the survivor's next gloo
operation fails at once (measured: about 30 ms after SIGKILL); a peer that is alive but stops answering fails
the survivor's operation after the group's ``timeout``. Every such failure is a :class:`WeightSyncError` naming
the peer (role, sync rank, pid, host; on the same host, whether the pid is gone; with several receivers the
sender names them all, marking the gone ones). After such a failure the group refuses further syncs (make a new
one); a rejected sync leaves it usable. A receiver waiting for the
next sync polls the store the sender hosts (``receive(wait_timeout=None)`` waits without bound while the
sender's process lives; the store's connection fails when it dies). The sender keeps draining the export after
a transport failure so the other training ranks never wait in a ZeRO-3 gather, and then all training ranks
raise together (an all-reduce of the outcome over the training world).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import socket
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dscore.errors import WeightSyncError

__all__ = ["WeightSyncGroup", "WeightSyncReceiver", "WeightSyncSender"]

MAGIC = 0x5753594E  # "WSYN"
HEADER, BUCKET, END, ABORT = 1, 2, 3, 4
_KIND_NAMES = {HEADER: "HEADER", BUCKET: "BUCKET", END: "END", ABORT: "ABORT"}
_ALIGN = 16
_DIRECT_MIN = 1 << 18  # tensors of 256 KiB or more travel alone, smaller ones packed into one buffer
_POLL_S = 0.02
_CPU = torch.device("cpu")

_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}

_open_groups: weakref.WeakSet[WeightSyncGroup] = weakref.WeakSet()


@atexit.register
def _close_open_groups() -> None:
    # a gloo group alive into interpreter finalization may abort the exit (dscore/comm/exit_drain.py)
    for group in list(_open_groups):
        group.close()


def _seconds(value: Any, what: str, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise WeightSyncError(f"{what}={value!r}: a positive number of seconds or a timedelta"
                              + (" (or None: no bound)" if allow_none else ""))
    return float(value)


def _pid_gone(pid: int) -> bool:
    """Whether ``pid`` on this host has exited (no such process, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class WeightSyncGroup:
    """A process group of one sender (sync rank 0, a training rank) and ``world_size - 1`` receivers (generation
    processes), rendezvoused over a ``TCPStore`` the sender hosts at ``host:port``.

    Every member constructs it with the same ``host``, ``port``, ``world_size`` and its own ``rank``; the
    constructor returns once all members joined (within ``timeout``). It creates its groups directly
    (``ProcessGroupGloo``/``ProcessGroupNCCL`` objects), never through ``init_process_group``: the caller's default
    group, if any, is untouched. Call :meth:`close` when done (also a context manager; open groups are closed at
    exit, before the interpreter finalizes). After a transport failure (a peer died or timed out) the group refuses
    further syncs: close it and rendezvous a new one; a sync a receiver rejected leaves it usable.

    Args:
        host: the sender's address (the store's host), str.
        port: the store's TCP port, int in 1..65535.
        world_size: members, int >= 2 (one sender + receivers).
        rank: this member's sync rank: 0 the sender, 1..world_size-1 a receiver.
        timeout: bound (seconds or timedelta) on every transport operation; a peer alive but silent for longer
            fails the operation. Default 300 s.
        rendezvous_timeout: bound on waiting for every member to join (processes still starting); None: ``timeout``.
        device: where bucket bytes travel: ``"cpu"`` (gloo) or a CUDA device (NCCL); every member of a group must
            choose the same kind.

    Raises:
        WeightSyncError: a bad argument (named), a member missing at the rendezvous within ``timeout``, mixed
            data backends, or NCCL asked for where torch has none.
    """

    def __init__(
        self, host: str, port: int, world_size: int, rank: int, *, timeout: float | timedelta = 300.0,
        device: str | torch.device = "cpu", rendezvous_timeout: float | timedelta | None = None,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise WeightSyncError(f"WeightSyncGroup(host={host!r}): the sender's address, a non-empty str")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise WeightSyncError(f"WeightSyncGroup(port={port!r}): a TCP port, int in 1..65535")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise WeightSyncError(f"WeightSyncGroup(world_size={world_size!r}): int >= 2 (the sender and receivers)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise WeightSyncError(f"WeightSyncGroup(rank={rank!r}): int in 0..{world_size - 1} (0 is the sender)")
        seconds = _seconds(timeout, "WeightSyncGroup(timeout")
        assert seconds is not None
        join_s = _seconds(rendezvous_timeout, "WeightSyncGroup(rendezvous_timeout", allow_none=True) or seconds
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise WeightSyncError(f"WeightSyncGroup(device={device!r}): 'cpu' or a CUDA device ({exc})") from None
        if dev.type not in ("cpu", "cuda"):
            raise WeightSyncError(f"WeightSyncGroup(device={device!r}): 'cpu' (gloo) or a CUDA device (NCCL)")
        gpu = torch.get_device_module("cuda")  # NCCL moves CUDA tensors only
        if dev.type == "cuda" and (getattr(dist, "ProcessGroupNCCL", None) is None or not gpu.is_available()):
            raise WeightSyncError(f"WeightSyncGroup(device={device!r}): this torch build or machine has no NCCL/CUDA; "
                                  "use device='cpu' (gloo)")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", gpu.current_device())
        self.host, self.port, self.world_size, self.rank = host, port, world_size, rank
        self.timeout_s = seconds
        self.device = dev
        self.backend = "gloo" if dev.type == "cpu" else "nccl"
        self.seq = 0
        self._closed = False
        self._broken = ""
        delta = timedelta(seconds=seconds)
        self.store = self._connect(join_s)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "backend": self.backend, "world_size": world_size}
        self.store.set(f"wsync/member/{rank}", json.dumps(me))
        self.members: list[dict[str, Any]] = []
        try:
            for r in range(world_size):
                self.store.wait([f"wsync/member/{r}"], timedelta(seconds=join_s))
                self.members.append(json.loads(self.store.get(f"wsync/member/{r}").decode()))
        except Exception as exc:
            raise WeightSyncError(f"WeightSyncGroup: not every member joined {host}:{port} within {join_s:g}s: {exc}",
                                  ) from exc
        self.store.set_timeout(delta)
        sizes = sorted({m["world_size"] for m in self.members})
        if len(sizes) > 1:
            raise WeightSyncError(f"WeightSyncGroup(world_size={world_size}): the members disagree ({sizes})")
        mixed = sorted({m["backend"] for m in self.members})
        if len(mixed) > 1:
            raise WeightSyncError(
                f"WeightSyncGroup(device=...): members chose different data backends {mixed}; all members must use "
                "'cpu' (gloo) or all CUDA devices (NCCL)"
            )
        try:
            self.ctrl: Any = dist.ProcessGroupGloo(dist.PrefixStore("wsync/ctrl", self.store), rank, world_size, delta)
            self.data: Any = self.ctrl
            if self.backend == "nccl":
                nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
                opts = nccl.Options()
                opts._timeout = delta
                gpu.set_device(dev)
                self.data = nccl(dist.PrefixStore("wsync/nccl", self.store), rank, world_size, opts)
            # every member returns only once all formed the groups: a sync never starts half-connected
            ctrl: Any = self.ctrl
            ctrl.allreduce([torch.zeros(1, dtype=torch.int64, device=_CPU)]).wait()
        except Exception as exc:
            raise self._failed("forming the process group", exc, None) from exc
        _open_groups.add(self)

    def _connect(self, join_s: float) -> Any:
        """The store: sync rank 0 serves it; a receiver first waits (plain TCP probes every 0.1 s, until ``join_s``)
        for the server to listen, since torch's client, started before its server, backs off for up to a minute
        between tries and logs a warning at each."""
        deadline = time.monotonic() + join_s

        def failed(exc: BaseException) -> WeightSyncError:
            return WeightSyncError(
                f"WeightSyncGroup: rendezvous at {self.host}:{self.port} ({self.world_size} members, rank {self.rank}) "
                f"failed within {join_s:g}s: {exc}"
            )

        if self.rank != 0:
            while True:
                try:
                    socket.create_connection((self.host, self.port), timeout=1.0).close()
                    break
                except OSError as exc:
                    if time.monotonic() + 0.1 >= deadline:
                        raise failed(exc) from exc
                time.sleep(0.1)
        remaining = max(deadline - time.monotonic(), 1.0)
        try:
            return dist.TCPStore(self.host, self.port, self.world_size, self.rank == 0,
                                 timeout=timedelta(seconds=join_s if self.rank == 0 else remaining),
                                 wait_for_workers=False)
        except Exception as exc:  # torch raises RuntimeError / DistStoreError / DistNetworkError
            raise failed(exc) from exc

    # ------------------------------------------------------------------ naming and failures
    def describe(self, rank: int) -> str:
        """``"sender (sync rank 0, pid 123 on host)"`` for member ``rank``; notes a pid gone on this host."""
        m = self.members[rank]
        role = "sender" if rank == 0 else "receiver"
        text = f"{role} (sync rank {rank}, pid {m['pid']} on {m['host']}"
        if m["host"] == socket.gethostname() and _pid_gone(int(m["pid"])):
            text += ", process gone"
        return text + ")"

    def peers(self) -> str:
        """The members other than this one, described (for error messages)."""
        return ", ".join(self.describe(r) for r in range(self.world_size) if r != self.rank)

    def _failed(self, what: str, exc: BaseException, step: int | None) -> WeightSyncError:
        peer = self.describe(0) if self.rank != 0 else self.peers()
        self._broken = f"{what} failed (peer {peer})"  # the frames are out of step now: no further sync
        return WeightSyncError(
            f"weight sync{'' if step is None else f' of step {step}'}: {what} failed; peer {peer} died or stopped "
            f"answering (bound {self.timeout_s:g}s): {type(exc).__name__}: {str(exc)[:300]}",
            peer=peer, step=step,
        )

    # ------------------------------------------------------------------ transport
    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("WeightSyncGroup: the group is closed")
        if self._broken:
            raise WeightSyncError(f"WeightSyncGroup: an earlier sync's {self._broken}; close this group and "
                                  "rendezvous a new one (on a fresh port)")

    def _bcast(self, pg: Any, tensor: torch.Tensor, what: str, step: int | None) -> None:
        try:
            pg.broadcast([tensor], dist.BroadcastOptions()).wait()
        except Exception as exc:
            raise self._failed(what, exc, step) from exc

    def _bcast_start(self, pg: Any, tensor: torch.Tensor, what: str, step: int | None) -> tuple[Any, torch.Tensor, str]:
        """Start a broadcast; :meth:`_bcast_finish` waits for it (the tensor is kept alive until then)."""
        try:
            return pg.broadcast([tensor], dist.BroadcastOptions()), tensor, what
        except Exception as exc:
            raise self._failed(what, exc, step) from exc

    def _bcast_finish(self, pending: list[tuple[Any, torch.Tensor, str]], step: int | None) -> None:
        while pending:
            work, _, what = pending.pop(0)
            try:
                work.wait()
            except Exception as exc:
                pending.clear()
                raise self._failed(what, exc, step) from exc

    def send_frame(self, kind: int, a: int, meta: dict[str, Any], step: int | None) -> None:
        """Sender: broadcast one control frame (``kind``, ``a``, JSON ``meta``)."""
        raw = json.dumps(meta).encode()
        self._bcast(self.ctrl, torch.tensor([MAGIC, kind, a, len(raw)], dtype=torch.int64, device=_CPU),
                    f"sending the {_KIND_NAMES[kind]} frame", step)
        self._bcast(self.ctrl, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(_CPU),
                    f"sending the {_KIND_NAMES[kind]} metadata", step)

    def recv_frame(self, step: int | None) -> tuple[int, int, dict[str, Any]]:
        """Receiver: the next control frame as ``(kind, a, meta)``."""
        head = torch.zeros(4, dtype=torch.int64, device=_CPU)
        self._bcast(self.ctrl, head, "receiving a control frame", step)
        magic, kind, a, n = (int(v) for v in head.tolist())
        if magic != MAGIC or kind not in _KIND_NAMES or n < 0:
            raise WeightSyncError(f"weight sync: a malformed control frame {head.tolist()} from {self.describe(0)}",
                                  peer=self.describe(0), step=step)
        raw = torch.zeros(n, dtype=torch.uint8, device=_CPU)
        self._bcast(self.ctrl, raw, f"receiving the {_KIND_NAMES[kind]} metadata", step)
        return kind, a, json.loads(bytes(raw.numpy()).decode())

    def ack(self, reject: bool, what: str, step: int | None) -> list[int]:
        """Every member: all-reduce the reject slots; returns the sync ranks that rejected."""
        slots = torch.zeros(self.world_size, dtype=torch.int64, device=_CPU)
        slots[self.rank] = int(reject)
        try:
            self.ctrl.allreduce([slots]).wait()
        except Exception as exc:
            raise self._failed(f"acknowledging {what}", exc, step) from exc
        return [r for r, v in enumerate(slots.tolist()) if v]

    def close(self) -> None:
        """Drop the process groups (joins their worker threads) and the store connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _open_groups.discard(self)
        for name in ("data", "ctrl", "store"):
            if hasattr(self, name):
                delattr(self, name)

    def __enter__(self) -> WeightSyncGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class WeightSyncSender:
    """Send the engine's full weights to the receivers of a :class:`WeightSyncGroup`.

    Construct it on **every** training rank: ``send`` runs ``engine.iter_full_params`` (collective under ZeRO-3),
    and only ``src_rank`` transmits.

    Args:
        engine: a dscore engine (``iter_full_params``, ``global_rank``, ``device``).
        group: on ``src_rank`` its :class:`WeightSyncGroup` (this member sync rank 0); None on every other rank.
        bucket_bytes: most bytes per bucket (``iter_full_params``; a larger tensor is a bucket alone). Default 64 MiB.
        dtype: cast floating-point tensors to it on the way (the receiver's dtype must match); None: as held.
        trainable_only: only parameters with ``requires_grad`` (receivers then need ``allow_missing=True``).
        names: ``"hf"`` or ``"module"`` (``iter_full_params``).
        src_rank: the training global rank that sends, default 0.

    Raises:
        WeightSyncError: ``group`` given on a rank that does not send or missing on the one that does, or not sync
            rank 0; a bad ``bucket_bytes``/``dtype``/``names``/``src_rank`` (named).
    """

    def __init__(
        self, engine: Any, group: WeightSyncGroup | None, *, bucket_bytes: int = 64 << 20,
        dtype: torch.dtype | None = None, trainable_only: bool = False, names: str = "hf", src_rank: int = 0,
    ) -> None:
        if isinstance(src_rank, bool) or not isinstance(src_rank, int) or src_rank < 0:
            raise WeightSyncError(f"WeightSyncSender(src_rank={src_rank!r}): a training global rank, int >= 0")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise WeightSyncError(f"WeightSyncSender(bucket_bytes={bucket_bytes!r}): a positive number of bytes (int)")
        if dtype is not None and str(dtype) not in _DTYPES:
            raise WeightSyncError(f"WeightSyncSender(dtype={dtype!r}): None or one of {', '.join(_DTYPES)}")
        if names not in ("hf", "module"):
            raise WeightSyncError(f"WeightSyncSender(names={names!r}): 'hf' or 'module'")
        self.engine = engine
        self.rank = int(getattr(engine, "global_rank", 0))
        sending = self.rank == src_rank
        if sending and not isinstance(group, WeightSyncGroup):
            raise WeightSyncError(f"WeightSyncSender: training rank {self.rank} is src_rank; group must be its "
                                  f"WeightSyncGroup, not {group!r}")
        if not sending and group is not None:
            raise WeightSyncError(f"WeightSyncSender: group given on training rank {self.rank}, but src_rank is "
                                  f"{src_rank}; pass group=None on the ranks that do not send")
        if group is not None and group.rank != 0:
            raise WeightSyncError(f"WeightSyncSender: the group's rank is {group.rank}; the sender is sync rank 0")
        self.group = group
        self.src_rank = src_rank
        self.bucket_bytes, self.dtype, self.trainable_only, self.names = bucket_bytes, dtype, trainable_only, names

    def send(self, step: int) -> dict[str, int]:
        """Stream the current full weights as training step ``step``; every training rank calls it.

        Returns:
            ``{"step", "count" (tensors), "buckets", "bytes"}`` (on every training rank; counted locally).

        Raises:
            WeightSyncError: ``step`` not an int >= 0; on the sending rank a receiver that rejected a parameter
                (its reason, naming the parameter), died or stopped answering (named); on every training rank
                when the sending rank failed (the training ranks agree on the outcome before returning).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise WeightSyncError(f"WeightSyncSender.send(step={step!r}): the training step, int >= 0")
        buckets = self.engine.iter_full_params(
            bucket_bytes=self.bucket_bytes, dtype=self.dtype, trainable_only=self.trainable_only, names=self.names
        )
        failure: Exception | None = None
        stats = {"step": step, "count": 0, "buckets": 0, "bytes": 0}
        if self.group is None:
            for bucket in buckets:  # keep the export's collectives in step with the sender
                stats["count"] += len(bucket)
                stats["buckets"] += 1
        else:
            try:
                self._transmit(step, buckets, stats)
            except Exception as exc:  # still drain: the other ranks are inside the export's gathers
                failure = exc
                collections.deque(buckets, maxlen=0)
        self._agree(failure, step)
        return stats

    def _agree(self, failure: Exception | None, step: int) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64, device=self.engine.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if failure is None and int(flag.item()):
                raise WeightSyncError(f"weight sync of step {step}: the sending training rank {self.src_rank} failed "
                                      "(its error names the peer)", step=step)
        if failure is not None:
            raise failure

    def _transmit(self, step: int, buckets: Iterator[list[tuple[str, torch.Tensor]]], stats: dict[str, int]) -> None:
        g = self.group
        assert g is not None
        g._check_open()
        g.seq += 1
        g.store.set(f"wsync/announce/{g.seq}", str(step))  # wakes receivers polling for the next sync
        g.send_frame(HEADER, step, {"step": step, "seq": g.seq, "dtype": str(self.dtype)}, step)
        self._check_ack(g.ack(False, "the header", step), "the header", step)
        index = 0
        # a bucket's direct tensors are still in flight while the export makes the next bucket (overlap)
        pending: list[tuple[Any, torch.Tensor, str]] = []
        try:
            for bucket in buckets:
                g._bcast_finish(pending, step)
                entries: list[dict[str, Any]] = []
                packed = total = 0
                for name, t in bucket:
                    nbytes = t.numel() * t.element_size()
                    direct = nbytes >= _DIRECT_MIN
                    entries.append({"name": name, "shape": list(t.shape), "dtype": str(t.dtype), "nbytes": nbytes,
                                    "direct": direct, "offset": -1 if direct else packed})
                    packed = packed if direct else _aligned(packed + nbytes)
                    total += nbytes
                g.send_frame(BUCKET, index, {"packed_nbytes": packed, "nbytes": total, "entries": entries}, step)
                self._check_ack(g.ack(False, f"bucket {index}", step), f"bucket {index}", step)
                if packed:
                    flat = torch.empty(packed, dtype=torch.uint8, device=g.device)
                    for (_, t), e in zip(bucket, entries):
                        if not e["direct"]:
                            start, nbytes = int(e["offset"]), int(e["nbytes"])
                            flat[start : start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                    g._bcast(g.data, flat, f"sending bucket {index}'s {packed} packed bytes", step)
                for (name, t), e in zip(bucket, entries):
                    if e["direct"]:  # a large tensor goes as it is: no packing copy here, none on the receiver
                        raw = t.detach().to(g.device).contiguous().reshape(-1).view(torch.uint8)
                        pending.append(g._bcast_start(g.data, raw, f"sending bucket {index}'s tensor {name!r}", step))
                stats["count"] += len(bucket)
                stats["bytes"] += total
                index += 1
        except WeightSyncError:
            raise
        except Exception as exc:  # the export failed here: tell the receivers instead of leaving them waiting
            reason = f"{type(exc).__name__}: {exc}"
            try:
                g._bcast_finish(pending, step)
                g.send_frame(ABORT, step, {"reason": reason[:2000]}, step)
            except WeightSyncError:
                pass  # the receivers are gone too; the export's own error is the one to raise
            raise WeightSyncError(f"weight sync of step {step} aborted on the sender: {reason}", step=step) from exc
        g._bcast_finish(pending, step)
        stats["buckets"] = index
        g.send_frame(END, step, {"count": stats["count"], "buckets": index, "bytes": stats["bytes"]}, step)
        self._check_ack(g.ack(False, "the END frame", step), "the END frame", step)
        g.store.delete_key(f"wsync/announce/{g.seq}")

    def _check_ack(self, rejected: list[int], what: str, step: int) -> None:
        if not rejected:
            return
        g = self.group
        assert g is not None
        reasons = []
        for r in rejected:
            try:
                reasons.append(f"{g.describe(r)}: {g.store.get(f'wsync/reject/{g.seq}/{r}').decode()}")
            except Exception:
                reasons.append(f"{g.describe(r)}: (no reason recorded)")
        raise WeightSyncError(f"weight sync of step {step}: {what} rejected by " + "; ".join(reasons),
                              peer=", ".join(g.describe(r) for r in rejected), step=step)


class WeightSyncReceiver:
    """Receive weight syncs from the sender of a :class:`WeightSyncGroup` (this member a receiver).

    Args:
        group: this process's :class:`WeightSyncGroup` (sync rank >= 1).
        allow_missing: accept a sync that does not cover every target tensor (the sender's ``trainable_only``);
            unknown names, shape and dtype mismatches are errors either way.

    Raises:
        WeightSyncError: ``group`` not a receiver's group.
    """

    def __init__(self, group: WeightSyncGroup, *, allow_missing: bool = False) -> None:
        if not isinstance(group, WeightSyncGroup) or group.rank == 0:
            raise WeightSyncError(f"WeightSyncReceiver(group={group!r}): a WeightSyncGroup of a receiver (rank >= 1)")
        if not isinstance(allow_missing, bool):
            raise WeightSyncError(f"WeightSyncReceiver(allow_missing={allow_missing!r}): a bool")
        self.group = group
        self.allow_missing = allow_missing
        self.last_step: int | None = None

    def receive(self, into: torch.nn.Module | dict[str, torch.Tensor], *, wait_timeout: float | None = None) -> int:
        """Wait for the next sync and load it in place into ``into``; returns its training step.

        Args:
            into: a module (its ``state_dict(keep_vars=True)`` tensors: parameters and persistent buffers) or a
                dict ``name -> tensor``; each received tensor is copied into the tensor of that name (any device).
            wait_timeout: most seconds to wait for the sender to start the next sync (None: while the sender's
                process lives). Once a sync started, every operation is bounded by the group's ``timeout``.

        Raises:
            WeightSyncError: an unknown name, a shape or dtype mismatch, or (unless ``allow_missing``) a target
                tensor the sync did not cover, each naming the parameter (the sender is told and raises too; a
                bucket is checked before any of it is copied, so a rejected sync may have loaded the buckets
                before the rejected one); the sender aborted (its reason), died or stopped answering (named);
                no sync started within ``wait_timeout``.
        """
        g = self.group
        g._check_open()
        wait_s = _seconds(wait_timeout, "WeightSyncReceiver.receive(wait_timeout", allow_none=True)
        if isinstance(into, torch.nn.Module):
            targets = dict(into.state_dict(keep_vars=True))
        elif isinstance(into, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in into.items()):
            targets = into
        else:
            raise WeightSyncError(f"WeightSyncReceiver.receive(into={type(into).__name__}): an nn.Module or a dict "
                                  "of str -> torch.Tensor")
        seq = g.seq + 1
        self._wait_announce(seq, wait_s)
        g.seq = seq
        kind, step, meta = g.recv_frame(None)
        if kind == ABORT:
            raise WeightSyncError(f"weight sync aborted by {g.describe(0)}: {meta.get('reason')}",
                                  peer=g.describe(0), step=step)
        if kind != HEADER or meta.get("seq") != seq:
            raise WeightSyncError(f"weight sync: expected HEADER of sync {seq}, got {_KIND_NAMES[kind]} {meta} from "
                                  f"{g.describe(0)}", peer=g.describe(0))
        self._ack(None, "the header", step)
        seen: set[str] = set()
        count = 0
        while True:
            kind, a, meta = g.recv_frame(step)
            if kind == ABORT:
                raise WeightSyncError(f"weight sync of step {step} aborted by {g.describe(0)}: {meta.get('reason')}",
                                      peer=g.describe(0), step=step)
            if kind == HEADER:
                raise WeightSyncError(f"weight sync of step {step}: a HEADER inside the sync from {g.describe(0)}",
                                      peer=g.describe(0), step=step)
            if kind == END:
                problem = None
                if a != step or meta.get("count") != count:
                    problem = WeightSyncError(
                        f"weight sync of step {step}: END says step {a}, {meta.get('count')} tensors; received {count}",
                        step=step)
                missing = sorted(set(targets) - seen)
                if problem is None and missing and not self.allow_missing:
                    problem = WeightSyncError(
                        f"weight sync of step {step}: {len(missing)} target tensor(s) not sent, first "
                        f"{missing[0]!r} (a different model, or the sender's trainable_only: allow_missing=True)",
                        name=missing[0], step=step)
                self._ack(problem, "the END frame", step)
                self.last_step = step
                return step
            entries = meta["entries"]
            self._ack(self._check_bucket(entries, targets, seen, step), f"bucket {a}", step)
            packed = int(meta["packed_nbytes"])
            flat = torch.empty(packed, dtype=torch.uint8, device=g.device)
            if packed:
                g._bcast(g.data, flat, f"receiving bucket {a}'s {packed} packed bytes", step)
            with torch.no_grad():
                for e in entries:
                    dst = targets[e["name"]].detach()
                    what = f"receiving bucket {a}'s tensor {e['name']!r}"
                    if e["direct"] and dst.device == g.device and dst.is_contiguous():
                        g._bcast(g.data, dst.reshape(-1).view(torch.uint8), what, step)  # straight into the target
                    elif e["direct"]:
                        buf = torch.empty(dst.shape, dtype=dst.dtype, device=g.device)
                        g._bcast(g.data, buf.reshape(-1).view(torch.uint8), what, step)
                        dst.copy_(buf)
                    else:
                        start, nbytes = int(e["offset"]), int(e["nbytes"])
                        dst.copy_(flat[start : start + nbytes].view(_DTYPES[e["dtype"]]).view(dst.shape))
                    seen.add(e["name"])
            count += len(entries)

    def _wait_announce(self, seq: int, wait_s: float | None) -> None:
        g = self.group
        deadline = None if wait_s is None else time.monotonic() + wait_s
        key = f"wsync/announce/{seq}"
        while True:
            try:
                if g.store.check([key]):
                    return
            except Exception as exc:
                raise g._failed("waiting for the next sync (the sender hosts the store)", exc, None) from exc
            if deadline is not None and time.monotonic() > deadline:
                raise WeightSyncError(f"weight sync: {g.describe(0)} started no sync within {wait_s:g}s",
                                      peer=g.describe(0))
            time.sleep(_POLL_S)

    def _check_bucket(self, entries: list[dict[str, Any]], targets: dict[str, torch.Tensor], seen: set[str],
                      step: int) -> WeightSyncError | None:
        for e in entries:
            name = e["name"]
            if name not in targets:
                from dscore.errors import did_you_mean

                close = did_you_mean(name, targets)
                return WeightSyncError(f"weight sync of step {step}: parameter {name!r} is not in the receiver's "
                                       f"target" + (f" (did you mean {close[0]!r}?)" if close else ""),
                                       name=name, step=step)
            dst = targets[name]
            if list(dst.shape) != e["shape"] or str(dst.dtype) != e["dtype"]:
                return WeightSyncError(
                    f"weight sync of step {step}: parameter {name!r} arrives as {e['dtype']}{e['shape']}, the target "
                    f"is {dst.dtype}{list(dst.shape)} (sender's dtype= must match the receiver's)", name=name,
                    step=step)
            if e["dtype"] not in _DTYPES:
                return WeightSyncError(f"weight sync of step {step}: parameter {name!r} has dtype {e['dtype']}, not "
                                       "one this transport carries", name=name, step=step)
            if name in seen:
                return WeightSyncError(f"weight sync of step {step}: parameter {name!r} sent twice", name=name,
                                       step=step)
        return None

    def _ack(self, problem: WeightSyncError | None, what: str, step: int) -> None:
        g = self.group
        if problem is not None:
            try:
                g.store.set(f"wsync/reject/{g.seq}/{g.rank}", str(problem))
            except Exception:
                pass  # the sender is gone: the ack below reports that
        rejected = g.ack(problem is not None, what, step)
        if problem is not None:
            raise problem
        if rejected:
            others = ", ".join(g.describe(r) for r in rejected)
            raise WeightSyncError(f"weight sync of step {step}: {what} rejected by {others}; the sync stops",
                                  peer=others, step=step)
