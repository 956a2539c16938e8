"""Start and supervise a set of processes (a node's ranks, or a runner's commands) until they end.

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
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import IO

from dscore.errors import LauncherError
from dscore.launcher.ranks import ProcessSpec

__all__ = ["TERMINATE_GRACE_S", "supervise", "become_subreaper", "PidFile"]

log = logging.getLogger("dscore.launcher")

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
TERMINATE_GRACE_S = 5.0

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

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
