"""Per-node launcher: ``python -u -m dscore.launcher.node ...`` (DeepSpeed's ``deepspeed.launcher.launch``).

Remote runners (pdsh, ssh) start this module on every node. It decodes the world info, starts this
node's ranks with :func:`dscore.launcher.local.supervise` (the same code as the local path) and exits
with the job's code. Flags mirror DeepSpeed's per-node launcher: ``--world_info`` (url-safe base64 of
``{"host": [slots]}`` JSON), ``--node_rank``, ``--master_addr``, ``--master_port``, ``--module``,
``--no_python``, ``--no_local_rank``, ``--enable_each_rank_log``, ``--bind_cores_to_rank``,
``--bind_core_list``, plus ``--visible_devices_env NAME`` (repeatable; from the launcher's accelerator) and
``--stdin_watchdog`` (ssh runner: when the ssh connection - this process's stdin - closes, the ranks
are stopped, so nothing survives a killed launcher).

``--mpi`` mode is used by the MPI-style runners (openmpi, mpich, mvapich, slurm): the process is one
rank already started by ``mpirun``/``srun``. It maps the MPI/SLURM rank variables to ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_SIZE`` (values already set win) and starts the training script
as its one supervised child (forwarding SIGINT/SIGTERM/SIGHUP to it, exiting with its code); like
DeepSpeed no ``--local_rank`` argument is added. It stays as the parent (instead of ``exec``) so that a
failing rank is reported on one recognisable line: MPICH's hydra does not end a job whose non-MPI
process exited non-zero, and ``srun`` reports the code of the ranks it terminated, so ``dscore run``
watches for that line and stops the job with the failed rank's code. ``--expand_env NAME``
(repeatable, in order) expands ``$NAME``/``${NAME}`` references in that variable from this node's
environment first (the ``.deepspeed_env`` remote-expansion rule, see :mod:`dscore.launcher.envfile`).

When a rank fails, the node launcher prints one line to stderr before exiting with the rank's code::

    dscore.launcher.node: node <node_rank> failed: <rank N (host h) exited with code C> [exit code C]

(``rank <R> failed`` in ``--mpi`` mode). The pdsh and MPI-style runners watch for it (pdsh prefixes it
with the host) to stop the whole job at once.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Mapping, Sequence

from dscore.errors import DscoreError, LauncherError
from dscore.launcher.envfile import expand_references

__all__ = ["encode_world_info", "decode_world_info", "parse_args", "mpi_rank_env", "main", "FAILURE_MARKER", "parse_failure_line"]

log = logging.getLogger("dscore.launcher.node")

#: Start of the line a node launcher prints when one of its ranks failed.
FAILURE_MARKER = "dscore.launcher.node: node "
_FAILURE_RE = re.compile(
    r"^(?:(?P<host>[^\s:]+): )?dscore\.launcher\.node: (?P<unit>node|rank) (?P<node>\d+) failed: (?P<what>.*) "
    r"\[exit code (?P<code>\d+)\]\s*$"
)
_PDSH_EXIT_RE = re.compile(r"^pdsh@[^:]*: (?P<host>[^\s:]+): ssh exited with exit code (?P<code>\d+)\s*$")


def parse_failure_line(line: str) -> tuple[int, str] | None:
    """``(exit code, cause)`` when ``line`` reports a failed node, else None.

    Understands the node launcher's failure line (optionally prefixed ``host: `` by pdsh) and pdsh's own
    ``pdsh@h: host: ssh exited with exit code N`` (a node launcher that died without a word).
    """
    match = _FAILURE_RE.match(line)
    if match:
        where = f" on {match.group('host')}" if match.group("host") else ""
        return int(match.group("code")), f"{match.group('unit')} {match.group('node')}{where}: {match.group('what')}"
    match = _PDSH_EXIT_RE.match(line)
    if match and match.group("code") != "0":
        return int(match.group("code")), f"the node launcher on {match.group('host')} exited with code {match.group('code')}"
    return None

#: (target variable, candidates in priority order) for ``--mpi`` mode.
MPI_ENV_MAP: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("RANK", ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")),
    (
        "LOCAL_RANK",
        (
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "PALS_LOCAL_RANKID",
            "MV2_COMM_WORLD_LOCAL_RANK",
            "SLURM_LOCALID",
        ),
    ),
    ("WORLD_SIZE", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")),
    ("LOCAL_SIZE", ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")),
)


def encode_world_info(world_info: Mapping[str, Sequence[int]]) -> str:
    """URL-safe base64 of ``json.dumps({host: [slots]})`` (DeepSpeed's ``--world_info`` encoding)."""
    data = json.dumps({h: list(s) for h, s in world_info.items()})
    return base64.urlsafe_b64encode(data.encode("utf-8")).decode("ascii")


def decode_world_info(text: str) -> dict[str, list[int]]:
    """Inverse of :func:`encode_world_info`.

    Raises:
        LauncherError: not base64 JSON of ``{host: [int, ...]}``.
    """
    try:
        value = json.loads(base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8"))
        if not isinstance(value, dict) or not value:
            raise ValueError("not a non-empty object")
        out = {str(h): [int(s) for s in slots] for h, slots in value.items()}
    except (ValueError, TypeError, UnicodeError) as exc:
        raise LauncherError(f"--world_info {text!r} is not base64 JSON of {{host: [slots]}}: {exc}") from None
    return out


def mpi_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_SIZE`` derived from the MPI or SLURM variables.

    Values already present in ``environ`` are kept. When several local-rank sources are set they must
    agree (DeepSpeed's launcher helper asserts the same).

    Raises:
        LauncherError: no rank variable found, or disagreeing local-rank variables.
    """
    out: dict[str, str] = {}
    for target, candidates in MPI_ENV_MAP:
        values = {c: environ[c] for c in candidates if environ.get(c, "") != ""}
        if target == "LOCAL_RANK" and len(set(values.values())) > 1:
            raise LauncherError(f"MPI local-rank variables disagree: {values}")
        if environ.get(target):
            out[target] = environ[target]
        elif values:
            out[target] = next(iter(values.values()))
    if "RANK" not in out:
        names = ", ".join(MPI_ENV_MAP[0][1])
        raise LauncherError(f"--mpi: no rank variable set (looked for RANK, {names}); start this under mpirun/srun")
    if "LOCAL_RANK" not in out:
        out["LOCAL_RANK"] = "0"
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dscore.launcher.node", allow_abbrev=False)
    p.add_argument("--world_info", default=None, help="url-safe base64 JSON {host: [slots]}")
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--local_rank_spelling", default="local_rank")
    p.add_argument("--enable_each_rank_log", default=None)
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--visible_devices_env", action="append", default=[], help="may be repeated")
    p.add_argument("--stdin_watchdog", action="store_true")
    p.add_argument("--mpi", action="store_true")
    p.add_argument("--expand_env", action="append", default=[], help="expand $NAME references in this variable")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _run_mpi_rank(args: argparse.Namespace) -> int:
    from dscore.launcher.ranks import ProcessSpec
    from dscore.launcher.supervise import supervise

    if args.module and args.no_python:
        raise LauncherError("--module and --no_python cannot be used together (a module needs python)")
    env = dict(os.environ)
    extra = mpi_rank_env(env)
    env.update(extra)
    for name in args.expand_env:
        if name in env:
            extra[name] = env[name] = expand_references(env[name], env)
    for name, value in (("MASTER_ADDR", args.master_addr), ("MASTER_PORT", str(args.master_port))):
        if name not in env:
            extra[name] = env[name] = value
    argv = [] if args.no_python else [sys.executable, "-u"] + (["-m"] if args.module else [])
    argv += [args.training_script, *args.training_script_args]
    rank = int(extra["RANK"])
    spec = ProcessSpec(argv=argv, env=extra, rank=rank, local_rank=int(extra["LOCAL_RANK"]), host=_hostname())
    failure: list[str] = []
    code = supervise([spec], failure=failure)
    if code != 0 and failure:
        print(f"{FAILURE_MARKER.replace('node ', 'rank ')}{rank} failed: {failure[0]} [exit code {code}]",
              file=sys.stderr, flush=True)  # fmt: skip
    return code


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _watch_stdin() -> None:
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    log.warning("launcher connection closed (stdin EOF); stopping this node's ranks")
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the node launcher's flags (``sys.argv[1:]`` when ``argv`` is None); argparse exits 2 on bad ones."""
    return _parser().parse_args(None if argv is None else list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments, else the job's code)."""
    from dscore.launcher.ranks import build_rank_processes, check_core_binding_tool
    from dscore.launcher.supervise import become_subreaper, supervise

    logging.basicConfig(level=logging.INFO, format="[dscore.node] %(levelname)s %(message)s")
    args = _parser().parse_args(argv)
    try:
        if args.mpi:
            return _run_mpi_rank(args)
        if args.world_info is None:
            raise LauncherError("--world_info is required (base64 JSON {host: [slots]})")
        world = decode_world_info(args.world_info)
        specs = build_rank_processes(
            world,
            args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            script=args.training_script,
            script_args=args.training_script_args,
            module=args.module,
            no_python=args.no_python,
            no_local_rank=args.no_local_rank,
            local_rank_spelling=args.local_rank_spelling,
            visible_devices_vars=args.visible_devices_env,
            each_rank_log=args.enable_each_rank_log,
            bind_cores_to_rank=args.bind_cores_to_rank,
            bind_core_list=args.bind_core_list,
        )
        check_core_binding_tool(specs)
        if args.stdin_watchdog:
            for spec in specs:
                spec.stdin = "devnull"
            # Process-directed signals must reach the main thread (blocked in os.waitpid), never the
            # watchdog: it starts with them blocked (a new thread inherits the creator's mask).
            blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM}
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                threading.Thread(target=_watch_stdin, name="stdin-watchdog", daemon=True).start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        become_subreaper()
        failure: list[str] = []
        code = supervise(specs, failure=failure)
        if code != 0 and failure:
            print(f"{FAILURE_MARKER}{args.node_rank} failed: {failure[0]} [exit code {code}]", file=sys.stderr, flush=True)
        return code
    except DscoreError as exc:
        print(f"dscore.launcher.node: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
