"""Where this process sits in the job: rank, world size, local rank and the rendezvous address.

:func:`discover_env` reads, in this order of precedence:

1. explicit arguments (``rank``/``world_size`` given to ``init_distributed``);
2. launcher variables set by torchrun or ``dscore run``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
3. MPI variables: OpenMPI ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``, MVAPICH
   ``MV2_COMM_WORLD_*``, MPICH/Intel MPI ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``;
   the rendezvous host comes from ``MASTER_ADDR``, AzureML's variables, mpi4py (rank 0's address,
   broadcast) when installed, or loopback on a single node;
4. SLURM step variables ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, host = first node of
   ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``; used only when neither 2 nor 3 is present, because
   ``srun torchrun ...`` legitimately gives SLURM counts of nodes, not ranks;
5. otherwise a single process: rank 0 of 1 on ``127.0.0.1`` with a free port (logged at INFO).

AzureML (``AZUREML_EXPERIMENT_ID`` without ``DLTS_JOB_ID``) and SageMaker (``SM_TRAINING_ENV``) are MPI
jobs; only their rendezvous address differs (DeepSpeed's rules, ``deepspeed/comm/comm.py``).

Sources that are both present must agree: explicit arguments with the launcher and MPI variables, and
the launcher with MPI, otherwise :class:`~dscore.errors.DistributedError` names both values. Two
legitimate nestings are recognised and not treated as disagreement: torchrun started per node by
``mpirun``/``srun`` (``TORCHELASTIC_RUN_ID`` is set), and any per-node launcher under MPI where the MPI
ranks are node ranks (``mpi_world * LOCAL_WORLD_SIZE == WORLD_SIZE`` and
``mpi_rank == RANK // LOCAL_WORLD_SIZE``).

Unlike DeepSpeed, a missing ``mpi4py`` is never an import error, and SLURM variables are understood.
This module does not import torch and never writes to the environment.

For a process group that already exists (the script called ``init_process_group`` itself, e.g. under
``mpirun``/``srun`` without any dscore launcher), :func:`existing_group_env` takes rank and world size
from the group and the local rank from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, else from the MPI variables
(OpenMPI, MVAPICH, MPICH) or SLURM's ``SLURM_LOCALID`` when they describe the same rank of the same job.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from dscore.errors import DistributedError

__all__ = ["DistributedEnv", "discover_env", "existing_group_env", "first_slurm_host", "find_free_port"]

log = logging.getLogger("dscore.comm.env")

_MPI_FLAVOURS: tuple[tuple[str, str, str, str, str], ...] = (
    # (flavour, rank, size, local rank, local size)
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)

AZUREML_SINGLE_NODE_PORT = 54965
AZUREML_MULTI_NODE_PORT = 6105


@dataclass(frozen=True)
class DistributedEnv:
    """This process's place in the job.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: rank among the processes of this node (selects the device).
        local_world_size: processes on this node (0 when no source says and the job spans hosts).
        master_addr: host of the rendezvous (rank 0's TCP store).
        master_port: TCP port of the rendezvous.
        source: where the values came from: ``"explicit"``, ``"launcher"``, ``"mpi:openmpi"``,
            ``"mpi:mpich"``, ``"mpi:mvapich"``, ``"azureml"``, ``"sagemaker"``, ``"slurm"``,
            ``"single-process"`` or ``"existing-process-group"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str

    def init_method(self) -> str:
        """``tcp://<master_addr>:<master_port>`` (IPv6 hosts bracketed)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"`` (zero padding kept).

    Raises:
        DistributedError: the list is empty or malformed.
    """
    text = nodelist.strip()
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\]([^,]*))?", text)
    if not text or match is None:
        raise DistributedError(f"cannot read a host from SLURM node list {nodelist!r}; expected e.g. 'node[01-04]'")
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3) or ""
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value.strip())
    except ValueError as exc:
        raise DistributedError(f"environment variable {name}={value!r} must be an integer") from exc


def _slurm_tasks_per_node(environ: Mapping[str, str]) -> int | None:
    # SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE look like "4(x2),3"; this node's count is unknown
    # in general, so only a uniform value is used.
    value = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_STEP_TASKS_PER_NODE") or ""
    match = re.fullmatch(r"\s*(\d+)(?:\(x\d+\))?\s*", value)
    return int(match.group(1)) if match else None


def _own_address() -> str:
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = ""
    if addr and not addr.startswith("127."):
        return addr
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5, check=False).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else (addr or host)


def _mpi4py_discovery() -> tuple[int, int, int, str] | None:
    """``(rank, size, local_rank, rank0_address)`` through mpi4py, or None when it is not installed."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    master = comm.bcast(_own_address() if rank == 0 else None, root=0)
    name = MPI.Get_processor_name()
    names = comm.allgather(name)
    local_rank = sum(1 for other in names[:rank] if other == name)
    return rank, size, local_rank, str(master)


@dataclass
class _Source:
    name: str
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None


def _disagree(a: _Source, b: _Source, field: str, name_a: str, name_b: str) -> DistributedError:
    return DistributedError(
        f"the distributed environment is contradictory: {name_a}={getattr(a, field)} ({a.name}) but "
        f"{name_b}={getattr(b, field)} ({b.name}). Launch with one launcher only, or fix the variables so "
        "that they describe the same job."
    )


_FIELD_NAMES = {
    "explicit": {"rank": "rank", "world_size": "world_size"},
    "launcher": {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"},
}


def _label(source: _Source, field: str, mpi_vars: tuple[str, str, str, str] | None) -> str:
    if source.name in _FIELD_NAMES:
        return _FIELD_NAMES[source.name].get(field, field)
    if mpi_vars is not None:
        return {"rank": mpi_vars[0], "world_size": mpi_vars[1], "local_rank": mpi_vars[2]}.get(field, field)
    return field


def _check_agreement(
    explicit: _Source, launcher: _Source | None, mpi: _Source | None, mpi_vars: tuple[str, str, str, str] | None,
    environ: Mapping[str, str],
) -> None:
    pairs: list[tuple[_Source, _Source]] = []
    if launcher is not None:
        pairs.append((explicit, launcher))
    if mpi is not None:
        nested = False
        if launcher is not None:
            lws = launcher.local_world_size
            nested = "TORCHELASTIC_RUN_ID" in environ or (
                lws is not None
                and mpi.world_size is not None
                and launcher.world_size is not None
                and launcher.rank is not None
                and mpi.world_size * lws == launcher.world_size
                and mpi.rank == launcher.rank // lws
                and mpi.world_size != launcher.world_size
            )
        if nested:
            log.debug("MPI variables describe per-node launcher processes; not compared with RANK/WORLD_SIZE")
        else:
            if launcher is not None:
                pairs.append((launcher, mpi))
            pairs.append((explicit, mpi))
    for a, b in pairs:
        for field in ("world_size", "rank", "local_rank"):
            va, vb = getattr(a, field), getattr(b, field)
            if va is not None and vb is not None and va != vb:
                raise _disagree(a, b, field, _label(a, field, mpi_vars), _label(b, field, mpi_vars))


def discover_env(
    *,
    rank: int = -1,
    world_size: int = -1,
    distributed_port: int = 29500,
    auto_mpi_discovery: bool = True,
    environ: Mapping[str, str] | None = None,
    quiet: bool = False,
) -> DistributedEnv:
    """Work out rank, world size, local rank and rendezvous address (see the module docstring).

    ``quiet`` logs the single-process fallback at DEBUG instead of INFO (for a look-ahead call that
    ``init_distributed`` repeats and logs).

    Args:
        rank: explicit global rank, or -1 to discover.
        world_size: explicit world size, or -1 to discover.
        distributed_port: rendezvous port used for MPI/SLURM jobs without ``MASTER_PORT`` (DeepSpeed's
            ``distributed_port``).
        auto_mpi_discovery: False ignores MPI, AzureML and SageMaker variables (and never imports mpi4py).
        environ: the environment to read (default ``os.environ``); it is never modified.

    Returns:
        A :class:`DistributedEnv`.

    Raises:
        DistributedError: sources disagree (both values are named), a value is not an integer or out of
            range, or a multi-node MPI/SageMaker job has no way to find the rendezvous host.
    """
    env = os.environ if environ is None else environ
    explicit = _Source("explicit", rank if rank >= 0 else None, world_size if world_size > 0 else None)

    launcher: _Source | None = None
    if "RANK" in env or "WORLD_SIZE" in env:
        launcher = _Source(
            "launcher", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
        )

    mpi: _Source | None = None
    mpi_vars: tuple[str, str, str, str] | None = None
    if auto_mpi_discovery:
        for flavour, r, s, lr, ls in _MPI_FLAVOURS:
            if r in env and s in env:
                mpi = _Source(f"mpi:{flavour}", _int(env, r), _int(env, s), _int(env, lr), _int(env, ls))
                mpi_vars = (r, s, lr, ls)
                break

    slurm: _Source | None = None
    if launcher is None and mpi is None and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        slurm = _Source(
            "slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID"),
            _slurm_tasks_per_node(env),
        )

    _check_agreement(explicit, launcher, mpi, mpi_vars, env)

    # the source whose process counts are used (explicit values override field by field)
    primary = launcher or mpi or slurm
    if primary is None and explicit.rank is None and explicit.world_size is None:
        addr = env.get("MASTER_ADDR") or "127.0.0.1"
        port = _int(env, "MASTER_PORT") or find_free_port()
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "no launcher, MPI or SLURM variables found: running as a single process (rank 0 of 1, "
            "rendezvous %s:%d)", addr, port,
        )
        return DistributedEnv(0, 1, 0, 1, addr, port, "single-process")

    base = primary or _Source("explicit")
    world = explicit.world_size if explicit.world_size is not None else base.world_size
    this_rank = explicit.rank if explicit.rank is not None else base.rank
    if world is None:
        raise DistributedError(
            f"rank is known ({this_rank}) but the world size is not: set WORLD_SIZE or pass world_size="
        )
    if this_rank is None:
        if world == 1:
            this_rank = 0
        else:
            raise DistributedError(f"the world size is {world} but this process's rank is unknown: set RANK or pass rank=")
    source = "explicit" if primary is None else primary.name

    mpi_is_rank_level = mpi is not None and mpi.world_size == world
    local_rank = base.local_rank
    local_world = base.local_world_size
    if local_rank is None and mpi_is_rank_level and mpi is not None:
        local_rank, local_world = mpi.local_rank, local_world or mpi.local_world_size

    # rendezvous address
    master_addr = env.get("MASTER_ADDR", "").strip()
    master_port = _int(env, "MASTER_PORT")
    if mpi is not None and source.startswith("mpi:"):
        azure = "AZUREML_EXPERIMENT_ID" in env and "DLTS_JOB_ID" not in env
        if azure:
            source = "azureml"
            single_node = local_world is not None and local_world == world
            if single_node and env.get("AZ_BATCHAI_MPI_MASTER_NODE"):
                master_addr = master_addr or env["AZ_BATCHAI_MPI_MASTER_NODE"]
                master_port = master_port or AZUREML_SINGLE_NODE_PORT
            elif env.get("AZ_BATCH_MASTER_NODE"):
                master_addr = master_addr or env["AZ_BATCH_MASTER_NODE"].split(":")[0]
                master_port = master_port or AZUREML_MULTI_NODE_PORT
        elif "SM_TRAINING_ENV" in env:
            source = "sagemaker"
            if not master_addr or master_port is None:
                raise DistributedError(
                    "SageMaker (SM_TRAINING_ENV) job without MASTER_ADDR/MASTER_PORT: SageMaker's MPI launcher "
                    "must export both (DeepSpeed has the same requirement)"
                )
        if not master_addr or local_rank is None:
            found = _mpi4py_discovery() if world > 1 else None
            if found is not None:
                m_rank, m_size, m_local, m_master = found
                if m_size != world or m_rank != this_rank:
                    raise DistributedError(
                        f"mpi4py reports rank {m_rank} of {m_size} but the environment says rank {this_rank} of {world}"
                    )
                master_addr = master_addr or m_master
                if local_rank is None:
                    local_rank = m_local
        master_port = master_port or distributed_port

    if slurm is not None and primary is slurm:
        if not master_addr:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if nodelist:
                master_addr = first_slurm_host(nodelist)
        master_port = master_port or distributed_port

    if local_world is None and local_rank is None:
        if world == 1:
            local_rank, local_world = 0, 1
        elif not master_addr or master_addr in {"127.0.0.1", "localhost", "::1"}:
            local_rank, local_world = this_rank, world
            log.warning("LOCAL_RANK is not set; assuming a single node (local_rank = rank = %d)", this_rank)
    if local_rank is None and local_world is not None:
        local_rank = this_rank % local_world
    if local_rank is None:
        raise DistributedError(
            f"cannot tell the local rank of rank {this_rank} (world size {world}, rendezvous {master_addr or '?'}): "
            "set LOCAL_RANK (torchrun and `dscore run` do), or LOCAL_WORLD_SIZE"
        )
    if local_world is None:
        local_world = world if not master_addr or master_addr in {"127.0.0.1", "localhost", "::1"} else 0

    if not master_addr:
        if world > 1 and local_world != world:
            raise DistributedError(
                f"multi-node job ({world} ranks, {local_world} per node, from {source}) but the rendezvous host is "
                "unknown: set MASTER_ADDR (and MASTER_PORT), or install mpi4py for MPI jobs"
            )
        master_addr = "127.0.0.1"
    if master_port is None:
        master_port = distributed_port if world > 1 else find_free_port()

    if not 0 <= this_rank < world:
        raise DistributedError(f"rank {this_rank} is outside [0, {world}) (world size {world}, from {source})")
    if local_rank < 0 or (local_world and local_rank >= local_world):
        raise DistributedError(
            f"local rank {local_rank} is outside [0, {local_world}) (local world size from {source})"
        )
    if not 0 < master_port < 65536:
        raise DistributedError(f"rendezvous port {master_port} is not a valid TCP port (1..65535)")
    return DistributedEnv(this_rank, world, local_rank, local_world, master_addr, master_port, source)


def existing_group_env(rank: int, world_size: int, *, environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """Describe a process group that already exists (``rank``/``world_size`` come from the group).

    The local rank is read, in order, from ``LOCAL_RANK`` (with ``LOCAL_WORLD_SIZE``); the MPI variables
    (``OMPI_COMM_WORLD_LOCAL_RANK``, ``MV2_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``) when that
    flavour's rank and size variables equal ``rank``/``world_size``; SLURM's ``SLURM_LOCALID`` when
    ``SLURM_PROCID``/``SLURM_NTASKS`` match. Without any of them, a one-process group has local rank 0
    and a larger one is assumed to be single-node (local rank = rank). ``MASTER_ADDR``/``MASTER_PORT``
    are reported as found ("" / 0 when unset). ``source`` is ``"existing-process-group"`` plus, when the
    local rank came from a launcher's variables, ``"+mpi:<flavour>"`` or ``"+slurm"``.

    Raises:
        DistributedError: a variable that is read is not an integer.
    """
    env = os.environ if environ is None else environ
    source = "existing-process-group"
    local_rank = _int(env, "LOCAL_RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE")
    if local_rank is None:
        for flavour, r, s, lr, ls in _MPI_FLAVOURS:
            if _int(env, r) == rank and _int(env, s) == world_size and _int(env, lr) is not None:
                local_rank, local_world = _int(env, lr), local_world or _int(env, ls)
                source += f"+mpi:{flavour}"
                break
    if local_rank is None and _int(env, "SLURM_PROCID") == rank and _int(env, "SLURM_NTASKS") == world_size:
        local_rank = _int(env, "SLURM_LOCALID")
        if local_rank is not None:
            local_world = local_world or _slurm_tasks_per_node(env)
            source += "+slurm"
    if local_rank is None:
        local_rank = 0 if world_size == 1 else rank
    if local_world is None:
        local_world = world_size
    port = _int(env, "MASTER_PORT") or 0
    return DistributedEnv(rank, world_size, local_rank, local_world, env.get("MASTER_ADDR", ""), port, source)
