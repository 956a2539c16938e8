"""Spawn and supervise the ranks of one node (the local launch path and the per-node launcher).

One process, no re-exec: the launcher starts each rank directly with :class:`subprocess.Popen`
(``start_new_session=True``, so every rank leads its own process group) and then blocks in
``os.waitpid`` - no polling. Policy (DeepSpeed's ``launch.py`` monitors every second and waits 30 s
before SIGKILL; dscore reacts at once and uses :data:`TERMINATE_GRACE_S`):

* a rank that exits non-zero or dies by a signal is named in an error log line; every other rank's
  process group receives SIGTERM at once, and SIGKILL after the grace period;
* SIGINT, SIGTERM and SIGHUP received by the launcher are forwarded to every rank's process group,
  with the same SIGKILL escalation;
* the launcher's exit code is the first failing rank's code (128+N for death by signal N), or 128+N
  when the launcher itself was stopped by signal N;
* when a rank exits, whatever is left in its process group is killed; at the end every rank's process
  group is killed again (leftover grandchildren), and on Linux the launcher
  is a child subreaper, so grandchildren that escaped with ``setsid`` are reparented to it and killed;
* on Linux every rank has ``PR_SET_PDEATHSIG=SIGKILL``, so even a launcher killed by SIGKILL takes its
  ranks with it.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from dscore.errors import LauncherError

__all__ = [
    "TERMINATE_GRACE_S",
    "ProcessSpec",
    "build_rank_processes",
    "rank_layout",
    "parse_range_list",
    "supervise",
    "become_subreaper",
    "check_core_binding_tool",
    "PidFile",
    "check_master_port",
    "pick_master_port",
    "port_holder",
]

log = logging.getLogger("dscore.launcher")

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
TERMINATE_GRACE_S = 5.0

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class ProcessSpec:
    """One process to start.

    Attributes:
        argv: the exact argument vector (no shell).
        env: variables set on top of the launcher's environment.
        rank: global rank (or the node index for a remote-runner command).
        local_rank: index on its node.
        host: host the process belongs to (for messages and the plan).
        label: how errors name it (``"rank 3"``, ``"node worker-1 (ssh)"``).
        log_path: file receiving stdout and stderr, or ``None`` to inherit the launcher's.
        unset: variables removed from the inherited environment.
        stdin: ``"inherit"`` (the launcher's stdin), ``"devnull"``, or ``"pipe"`` (a pipe the launcher holds
            open and never writes: it closes when the launcher dies, however it dies - the ssh runner
            uses this so the remote node launcher notices).
        watch: for a runner command whose output reports remote failures (pdsh): called with every
            output line; a ``(code, cause)`` result means a remote rank failed - the job's exit code and
            cause become these, and this process is stopped (its remote leftovers are then stopped by the
            plan's clean-up commands). The output is piped through the launcher, line by line.
    """

    argv: list[str]
    env: dict[str, str]
    rank: int = 0
    local_rank: int = 0
    host: str = "localhost"
    label: str = ""
    log_path: str | None = None
    unset: tuple[str, ...] = ()
    stdin: str = "inherit"
    watch: Callable[[str], tuple[int, str] | None] | None = field(default=None, repr=False, compare=False)

    def name(self) -> str:
        """The label, or ``"rank N"``."""
        return self.label or f"rank {self.rank}"


def parse_range_list(text: str) -> list[int]:
    """Parse ``--bind_core_list`` (``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``).

    Raises:
        LauncherError: a malformed item, a descending range, or overlapping/unsorted entries
            (DeepSpeed: ``ValueError "Bad range"``).
    """
    cores: list[int] = []
    for item in text.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            start = int(lo)
            end = int(hi) if dash else start
        except ValueError:
            raise LauncherError(f"--bind_core_list {text!r}: {item!r} is not N or N-M; expected e.g. 0,2-4,6") from None
        if end < start or (cores and start <= cores[-1]):
            raise LauncherError(f"--bind_core_list {text!r}: bad range {item!r} (ranges must ascend and not overlap)")
        cores.extend(range(start, end + 1))
    return cores


def rank_layout(world_info: Mapping[str, Sequence[int]]) -> list[tuple[str, int, int, int]]:
    """``(host, node_rank, global_rank, local_rank)`` for every slot, host by host in world-info order.

    ``local_rank`` is the index on the node. (DeepSpeed uses ``RANK % procs_on_this_node``, which is
    wrong on uneven nodes; dscore uses the index.)
    """
    out = []
    rank = 0
    for node_rank, (host, slots) in enumerate(world_info.items()):
        for local_rank in range(len(slots)):
            out.append((host, node_rank, rank, local_rank))
            rank += 1
    return out


def _core_binding(
    nprocs: int, local_rank: int, bind_core_list: str | None, environ: Mapping[str, str]
) -> tuple[list[str], int]:
    if "KMP_AFFINITY" in environ:
        raise LauncherError(
            f"--bind_cores_to_rank conflicts with KMP_AFFINITY={environ['KMP_AFFINITY']!r}; unset KMP_AFFINITY"
        )
    cores = parse_range_list(bind_core_list) if bind_core_list else sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // nprocs
    if per_rank < 1:
        raise LauncherError(
            f"--bind_cores_to_rank: {len(cores)} core(s) ({','.join(map(str, cores))}) cannot be split "
            f"among {nprocs} ranks on this node; give more cores with --bind_core_list or fewer ranks"
        )
    mine = cores[local_rank * per_rank : (local_rank + 1) * per_rank]
    return ["numactl", "-C", ",".join(map(str, mine))], per_rank


def build_rank_processes(
    world_info: Mapping[str, Sequence[int]],
    node_rank: int,
    *,
    master_addr: str,
    master_port: int,
    script: str,
    script_args: Sequence[str],
    python: str | None = None,
    module: bool = False,
    no_python: bool = False,
    no_local_rank: bool = False,
    visible_devices_vars: Sequence[str] = (),
    each_rank_log: str | None = None,
    bind_cores_to_rank: bool = False,
    bind_core_list: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[ProcessSpec]:
    """The processes of node ``node_rank``: argv and environment per rank (DeepSpeed ``launch.py`` layout).

    Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE`` (and torchrun's
    ``LOCAL_WORLD_SIZE``), ``CROSS_RANK`` (node rank), ``CROSS_SIZE`` (number of nodes), ``MASTER_ADDR``,
    ``MASTER_PORT``, each of ``visible_devices_vars`` (comma-joined slot ids of this node), and
    ``OMP_NUM_THREADS``: the bound core count with ``--bind_cores_to_rank``; otherwise, when the caller has
    not set it and more than one rank shares the node, ``max(1, cpu_count // ranks_on_node)`` so the ranks'
    intra-op thread pools do not oversubscribe the cores (torchrun sets 1 in that case; an even share
    keeps single-rank-per-core CPU jobs from being slowed several-fold). The command is
    ``[numactl -C cores] python -u [-m] script [--local_rank=N] args`` (``--no_python``: ``script args``).

    Raises:
        LauncherError: ``--module`` with ``--no_python``, an empty master address, a node rank out of range,
            a bad per-rank log directory, or an impossible core binding.
    """
    environ = os.environ if environ is None else environ
    if module and no_python:
        raise LauncherError("--module and --no_python cannot be used together (a module needs python)")
    if not master_addr:
        raise LauncherError("the master address is empty; pass --master_addr HOST")
    hosts = list(world_info)
    if not 0 <= node_rank < len(hosts):
        raise LauncherError(f"node rank {node_rank} is out of range: valid values are 0..{len(hosts) - 1}")
    host = hosts[node_rank]
    slots = list(world_info[host])
    layout = [entry for entry in rank_layout(world_info) if entry[1] == node_rank]
    world_size = sum(len(s) for s in world_info.values())
    if each_rank_log:
        if os.path.exists(each_rank_log) and not os.path.isdir(each_rank_log):
            raise LauncherError(f"--enable_each_rank_log {each_rank_log!r} exists and is not a directory")
        os.makedirs(each_rank_log, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
    python = python or sys.executable
    procs = []
    for _host, _node, rank, local_rank in layout:
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(len(slots)),
            "LOCAL_WORLD_SIZE": str(len(slots)),
            "CROSS_RANK": str(node_rank),
            "CROSS_SIZE": str(len(hosts)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        for var in visible_devices_vars:
            env[var] = ",".join(map(str, slots))
        argv: list[str] = []
        if bind_cores_to_rank:
            prefix, per_rank = _core_binding(len(slots), local_rank, bind_core_list, environ)
            argv += prefix
            env["OMP_NUM_THREADS"] = str(per_rank)
        elif "OMP_NUM_THREADS" not in environ and len(slots) > 1:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(slots)))
        if not no_python:
            argv += [python, "-u"] + (["-m"] if module else [])
        argv.append(script)
        if not no_local_rank:
            argv.append(f"--local_rank={local_rank}")
        argv += list(script_args)
        log_path = os.path.join(each_rank_log, f"{stamp}_rank{rank}.log") if each_rank_log else None
        procs.append(ProcessSpec(argv=argv, env=env, rank=rank, local_rank=local_rank, host=host, log_path=log_path))
    return procs


def check_core_binding_tool(specs: Sequence[ProcessSpec]) -> None:
    """Fail before starting anything when ``--bind_cores_to_rank`` needs ``numactl`` and it is missing.

    Raises:
        LauncherError: a spec starts with ``numactl`` and no ``numactl`` is on ``PATH``.
    """
    import shutil

    if any(spec.argv[:1] == ["numactl"] for spec in specs) and shutil.which("numactl") is None:
        raise LauncherError(
            "--bind_cores_to_rank needs numactl, which is not on PATH; install numactl (package 'numactl') "
            "or drop --bind_cores_to_rank"
        )


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``).

    Orphaned descendants (grandchildren whose parent died, including ones that called ``setsid``) are
    then reparented to the launcher, which kills them at the end. Returns False where unsupported.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """``preexec_fn`` of every rank: SIGKILL it if the launcher dies (even by SIGKILL) - Linux only."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _orphans_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[1] == str(pid):
            found.append(int(entry))
    return found


class PidFile:
    """``--save_pid``: ``<tmpdir>/<launcher pid>.deepspeed`` holding the launcher pid (DeepSpeed's name).

    Created on enter (it must not exist) and removed on exit, so nothing is left behind.

    Raises:
        LauncherError: the file already exists.
    """

    def __init__(self, pid: int | None = None, directory: str | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.path = os.path.join(directory or tempfile.gettempdir(), f"{self.pid}.deepspeed")

    def __enter__(self) -> PidFile:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise LauncherError(f"--save_pid: {self.path} already exists; remove it or stop the other job") from None
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{self.pid}\n")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _describe(status: int) -> tuple[int, str]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return 128 + sig, f"was killed by {name}"
    code = os.waitstatus_to_exitcode(status)
    return code, f"exited with code {code}"


class _Supervisor:
    def __init__(self, specs: Sequence[ProcessSpec], grace_s: float) -> None:
        self.specs = list(specs)
        self.grace_s = grace_s
        self.live: dict[int, tuple[ProcessSpec, subprocess.Popen[bytes]]] = {}
        self.groups: list[int] = []
        self.stopping = False
        self.exit_code = 0
        self.launcher_signal: int | None = None
        self.failure = ""
        self.reported: tuple[int, str] | None = None
        self.readers: list[threading.Thread] = []

    # Signal handlers run in the main thread between bytecodes; os.waitpid is retried afterwards (PEP 475).
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.launcher_signal is None:
            self.launcher_signal = signum
            log.warning(
                "launcher received %s; forwarding it to %d rank(s)", signal.Signals(signum).name, len(self.live)
            )
        self.stop(signum)

    def on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self.live:
            log.warning(
                "%d process(es) still running %.1f s after being asked to stop; sending SIGKILL: %s",
                len(self.live),
                self.grace_s,
                ", ".join(spec.name() for spec, _ in self.live.values()),
            )
        self._signal_groups(signal.SIGKILL, list(self.live))

    def stop(self, signum: int) -> None:
        self._signal_groups(signum, list(self.live))
        if not self.stopping:
            self.stopping = True
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    @staticmethod
    def _signal_groups(signum: int, pgids: Sequence[int]) -> None:
        for pgid in pgids:
            try:
                os.killpg(pgid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def spawn(self, spec: ProcessSpec) -> None:
        env = dict(os.environ)
        for name in spec.unset:
            env.pop(name, None)
        env.update(spec.env)
        out: IO[bytes] | None = open(spec.log_path, "ab") if spec.log_path else None  # noqa: SIM115
        piped = spec.watch is not None and out is None
        try:
            proc = subprocess.Popen(
                spec.argv,
                env=env,
                stdout=subprocess.PIPE if piped else out,
                stderr=subprocess.PIPE if piped else (subprocess.STDOUT if out else None),
                stdin={"devnull": subprocess.DEVNULL, "pipe": subprocess.PIPE}.get(spec.stdin),
                start_new_session=True,
                preexec_fn=_die_with_launcher if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )
        except OSError as exc:
            raise LauncherError(f"cannot start {spec.name()}: {spec.argv[0]!r}: {exc.strerror or exc}") from exc
        finally:
            if out is not None:
                out.close()
        self.live[proc.pid] = (spec, proc)
        self.groups.append(proc.pid)
        if piped:
            for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                reader = threading.Thread(target=self._relay, args=(spec, proc, stream, sink), daemon=True)
                reader.start()
                self.readers.append(reader)
        log.debug("started %s (pid %d): %s", spec.name(), proc.pid, spec.argv)

    def _relay(self, spec: ProcessSpec, proc: subprocess.Popen[bytes], stream: IO[bytes], sink: IO[str]) -> None:
        """Reader thread: copy ``stream`` to ``sink`` line by line and stop ``proc`` on a reported failure."""
        assert spec.watch is not None
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):
                pass
            hit = spec.watch(line.rstrip("\n"))
            if hit is not None and self.reported is None and not self.stopping:
                self.reported = hit
                log.error("%s; stopping %s and the ranks on every node", hit[1], spec.name())
                self._signal_groups(signal.SIGTERM, [proc.pid])
        stream.close()

    def run(self) -> int:
        try:
            for spec in self.specs:
                if self.stopping:
                    break
                self.spawn(spec)
        except LauncherError as exc:
            log.error("%s; stopping the %d process(es) already started", exc, len(self.live))
            self.exit_code = 1
            self.stop(signal.SIGTERM)
        while self.live:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            entry = self.live.pop(pid, None)
            if entry is None:
                continue  # an orphaned grandchild reparented to us (subreaper): reaped
            spec, proc = entry
            code, how = _describe(status)
            proc.returncode = os.waitstatus_to_exitcode(status)
            self._signal_groups(signal.SIGKILL, [pid])  # leftovers of that rank's group
            if self.reported is not None and not self.exit_code:
                code, how = self.reported[0] or code or 1, self.reported[1]
                self.exit_code = code
                self.failure = how
                self.stop(signal.SIGTERM)
                continue
            if code != 0 and not self.stopping:
                self.exit_code = code
                self.failure = f"{spec.name()} (host {spec.host}) {how}"
                log.error(
                    "%s (pid %d, host %s) %s; terminating the other %d process(es)",
                    spec.name(),
                    pid,
                    spec.host,
                    how,
                    len(self.live),
                )
                self.stop(signal.SIGTERM)
            elif code != 0:
                log.info("%s (pid %d) %s", spec.name(), pid, how)
        if self.launcher_signal is not None and self.exit_code == 0:
            self.exit_code = 128 + self.launcher_signal
        return self.exit_code

    def cleanup(self) -> None:
        for reader in self.readers:
            reader.join(timeout=5.0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._signal_groups(signal.SIGKILL, self.groups)
        self._signal_groups(signal.SIGKILL, list(self.live))
        for pid, (_, proc) in list(self.live.items()):
            proc.wait()
            self.live.pop(pid, None)
        for _ in range(50):
            orphans = _orphans_of(os.getpid())
            if not orphans:
                break
            for pid in orphans:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    time.sleep(0.01)


def supervise(
    specs: Sequence[ProcessSpec], *, grace_s: float = TERMINATE_GRACE_S, failure: list[str] | None = None
) -> int:
    """Start ``specs`` and wait for all of them; returns the job's exit code.

    Must run in the main thread of a process that owns no other children (it reaps with
    ``os.waitpid(-1)`` and installs SIGINT/SIGTERM/SIGHUP/SIGALRM handlers, restored on return): the
    ``dscore run`` process or the per-node launcher.

    Args:
        specs: processes to start, in order.
        grace_s: seconds from SIGTERM to SIGKILL when stopping.
        failure: when given, the first failure's description (``"rank 1 (host h) exited with code 7"``)
            is appended to it.

    Returns:
        0 when every process exited 0; else the first failing process's code (128+N for signal N), or
        128+N when the launcher was stopped by signal N; 1 when a process could not be started.
    """
    sup = _Supervisor(specs, grace_s)
    previous = {sig: signal.signal(sig, sup.on_signal) for sig in _FORWARDED}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, sup.on_alarm)
    try:
        code = sup.run()
        if failure is not None and sup.failure:
            failure.append(sup.failure)
        return code
    finally:
        sup.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------- rendezvous port (single node)
def _bind_error(port: int) -> OSError | None:
    """None when a listening socket could take ``port`` on every interface now, else the bind error.

    Rank 0's store listens on all interfaces (IPv6 dual-stack where available) with SO_REUSEADDR, so the
    probe does the same: a port in TIME_WAIT counts as free, one another process listens on does not.
    """
    import socket

    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # family not configured on this machine
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno not in (98,):  # EADDRINUSE only; no IPv6 is fine
                continue
            return exc
        finally:
            sock.close()
    return None


def pick_master_port() -> int:
    """A TCP port nothing listens on now (asked from the kernel), for a single-node run's rendezvous."""
    import socket

    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if _bind_error(port) is None:
            return port
    raise LauncherError("could not find a free TCP port for the rendezvous; pass --master_port")


def port_holder(port: int) -> str:
    """``"pid 123 (python train.py)"`` for the process listening on TCP ``port``, or ``""`` when it cannot
    be seen (another user's process, no /proc, psutil absent and /proc unreadable)."""
    try:
        import psutil  # optional (the launcher extra); /proc below otherwise

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f"pid {conn.pid} ({' '.join(' '.join(psutil.Process(conn.pid).cmdline()).split())[:120]})"
    except Exception:  # noqa: BLE001 - psutil missing or not allowed: try /proc
        pass
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    if not inodes:
        return ""
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        cmd = " ".join(fh.read().replace(b"\0", b" ").decode(errors="replace").split())
                    return f"pid {pid} ({cmd[:120]})"
            except OSError:
                continue
    return ""


def check_master_port(port: int) -> None:
    """Fail before any rank starts when ``port`` (an explicit ``--master_port``) is taken on this node.

    Raises:
        LauncherError: naming the port, the process holding it when visible, and ``--master_port``.
    """
    if not 0 < port < 65536:
        raise LauncherError(f"--master_port {port} is not a TCP port (1..65535)")
    error = _bind_error(port)
    if error is None:
        return
    holder = port_holder(port)
    raise LauncherError(
        f"--master_port {port} is already in use on this node"
        + (f" by {holder}" if holder else "")
        + f" ({error.strerror or error}); rank 0 could not listen there. Pass another --master_port, or leave "
        "it out to let a single-node run pick a free port."
    )
