"""The ranks of one node: their layout, environment and argument vectors (DeepSpeed ``launch.py``'s layout).

:func:`build_rank_processes` turns the job's world info into one :class:`ProcessSpec` per rank of a node
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... and ``[numactl -C cores] python -u script --local_rank=N
args``); the local launch path, the per-node launcher and every runner's per-rank layout use it.
:class:`ProcessSpec` is also what a runner returns for the command(s) the launcher starts.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dscore.errors import LauncherError

__all__ = [
    "LOCAL_RANK_SPELLINGS",
    "ProcessSpec",
    "build_rank_processes",
    "rank_layout",
    "parse_range_list",
    "check_core_binding_tool",
]

#: How the local rank reaches the script: ``--local_rank=N`` (DeepSpeed's launcher) or ``--local-rank=N``
#: (torchrun's spelling since torch 2.0; argparse maps both to ``args.local_rank`` only if the script
#: declares that spelling).
LOCAL_RANK_SPELLINGS = ("local_rank", "local-rank")


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
    local_rank_spelling: str = "local_rank",
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
    ``[numactl -C cores] python -u [-m] script [--local_rank=N] args`` (``--no_python``: ``script args``);
    ``local_rank_spelling="local-rank"`` spells the argument ``--local-rank=N`` (torchrun's).

    Raises:
        LauncherError: ``--module`` with ``--no_python``, an empty master address, a node rank out of range,
            a bad per-rank log directory, an impossible core binding, or a ``local_rank_spelling`` other than
            those of :data:`LOCAL_RANK_SPELLINGS`.
    """
    environ = os.environ if environ is None else environ
    if local_rank_spelling not in LOCAL_RANK_SPELLINGS:
        raise LauncherError(
            f"--local_rank_spelling {local_rank_spelling!r}: expected one of {', '.join(LOCAL_RANK_SPELLINGS)}"
        )
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
            argv.append(f"--{local_rank_spelling}={local_rank}")
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
