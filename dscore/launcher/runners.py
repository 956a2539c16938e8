"""Multi-node runners: the commands that start a job on several hosts.

Every runner turns a :class:`RunnerContext` into the command(s) the launcher executes locally (as
:class:`~dscore.launcher.local.ProcessSpec`) and the per-rank layout the job will have. Shapes follow
DeepSpeed's ``multinode_runner.py`` (0.19.8); differences are noted per runner.

Shell-based runners (``pdsh``, ``ssh``) start ``python -u -m dscore.launcher.node`` on each host with the
world info, after ``export NAME=value;`` for each exported variable (quoted, see
:mod:`dscore.launcher.envfile`) and ``cd <cwd>;``. MPI-style runners (``openmpi``, ``mpich``, ``impi``,
``mvapich``, ``slurm``) let ``mpirun``/``srun`` start every rank and pass the environment as arguments (or,
for slurm, through srun's own environment); ranks read their rank from the MPI variables through
``python -m dscore.launcher.node --mpi`` (``impi`` sets ``RANK``/``LOCAL_RANK`` explicitly per rank). They
place ranks by count, so they accept host-level include/exclude/--num_nodes but reject filters that pick
particular slots, and (except openmpi) uneven slot counts. ``user@host`` entries need an ssh-based runner.

Which program: Debian-like systems install Open MPI and MPICH side by side, and plain ``mpirun`` is
whichever the alternatives system picked. So each MPI runner looks for its own flavour's program first
(openmpi: ``mpirun.openmpi``, ``mpiexec.openmpi``, ``orterun``; mpich: ``mpiexec.hydra``,
``mpirun.mpich``, ``mpiexec.mpich``) and falls back to ``mpirun``, whose ``--version`` must then name the
right flavour (checked before anything starts, see :func:`check_program`). The program used is logged.

``--ssh_port``: pdsh (``PDSH_SSH_ARGS_APPEND``, for the job and its clean-up), ssh (``-p``), openmpi
(``--mca plm_rsh_args "-p N"``, how mpirun starts its daemons), the hydra-based mpirun of mpich, impi and
mvapich (``HYDRA_LAUNCHER_EXTRA_ARGS``); slurm refuses it (srun does not use ssh).

Failure and clean-up: ``pdsh -S`` only returns after every node's command ended, so the pdsh runner
watches pdsh's output for a node launcher's failure line (:func:`dscore.launcher.node.parse_failure_line`)
or pdsh's ``ssh exited with exit code N``; on the first one it stops pdsh and runs the clean-up command
(``pkill`` of this job's node launchers on every host, through pdsh with the same rcmd type and
``--ssh_port``), and ``dscore run`` exits with the failed rank's code. The ssh runner stops the other
hosts' ssh connections, which ends their node launchers (stdin watchdog). The MPI-style runners
(except impi) watch ``mpirun``/``srun`` output for the per-rank entry's failure line the same way, and
stop the job with the failed rank's code: Open MPI's ``mpirun`` would end the job itself, but MPICH's
hydra waits for every non-MPI process and ``srun`` reports the code of the ranks it terminated.
``srun`` also gets ``--kill-on-bad-exit=1`` unless ``--launcher_args`` sets it.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from dscore.errors import LauncherError
from dscore.launcher.envfile import EnvVar, shell_export
from dscore.launcher.hostfile import Host
from dscore.launcher.local import ProcessSpec, build_rank_processes
from dscore.launcher.node import encode_world_info, parse_failure_line
from dscore.launcher.resources import WorldInfo

__all__ = ["RunnerContext", "Runner", "RUNNERS", "get_runner", "NODE_MODULE", "check_program"]

log = logging.getLogger("dscore.launcher")

_which = shutil.which  # indirection so plan tests can pretend no MPI program is installed

#: The per-node launcher module started on every host.
NODE_MODULE = "dscore.launcher.node"

#: DeepSpeed's MVAPICH defaults (``MV2_USE_CUDA=1`` is added for accelerators with a visible-devices variable).
MVAPICH_DEFAULT_ENV: tuple[tuple[str, str], ...] = (
    ("MV2_SMP_USE_CMA", "0"),
    ("MV2_DEBUG_SHOW_BACKTRACE", "1"),
    ("MV2_SUPPORT_DL", "1"),
    ("MV2_ENABLE_AFFINITY", "0"),
    ("MV2_INTER_ALLGATHER_TUNING", "5"),
    ("MV2_CUDA_USE_NAIVE", "0"),
)


@dataclass
class RunnerContext:
    """Everything a runner needs to build its commands.

    Attributes:
        world_info: host -> slots after filtering (hostfile order).
        hosts: host name -> hostfile entry (for ``user@host``).
        master_addr / master_port: rendezvous address (never empty here).
        script / script_args: the training script and its arguments, unchanged.
        python: interpreter path used on every host.
        cwd: working directory the ranks start in.
        exports: variables exported to every node.
        launcher_args: ``--launcher_args`` split with :func:`shlex.split`.
        filtered_by: the filter option that shaped ``world_info`` (for messages), or "".
    """

    world_info: WorldInfo
    hosts: dict[str, Host]
    master_addr: str
    master_port: int
    script: str
    script_args: list[str]
    python: str
    cwd: str
    exports: list[EnvVar] = field(default_factory=list)
    launcher_args: list[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    ssh_port: int | None = None
    venv_script: str | None = None
    visible_devices_vars: tuple[str, ...] = ()
    each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    filtered_by: str = ""

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return sum(len(s) for s in self.world_info.values())

    def target(self, host: str) -> str:
        """``user@host`` when the hostfile gave a user, else ``host``."""
        entry = self.hosts.get(host)
        return entry.target if entry else host


class Runner:
    """Base class: a named multi-node backend.

    Subclasses set :attr:`name` and :attr:`binary` and implement :meth:`commands`; :meth:`validate` raises
    for inputs the backend cannot honour.
    """

    name = ""
    binary = ""
    #: programs tried in order; the first on PATH is used (the last is the generic fallback).
    programs: tuple[str, ...] = ()
    #: text that ``<generic program> --version`` must contain for this flavour ("" = no check).
    flavour_marker = ""
    uses_shell = False
    passes_local_rank = False

    def program(self) -> str:
        """The executable this runner starts: the first of :attr:`programs` on ``PATH``, else the last."""
        candidates = self.programs or (self.binary,)
        for name in candidates:
            if _which(name):
                return name
        return candidates[-1]

    def validate(self, ctx: RunnerContext) -> None:
        """Reject inputs the backend cannot honour.

        Raises:
            LauncherError: naming the option and value and what the runner accepts.
        """
        if not self.uses_shell:
            users = [ctx.hosts[h].target for h in ctx.world_info if h in ctx.hosts and ctx.hosts[h].user]
            if users:
                raise LauncherError(
                    f"--launcher {self.name}: hostfile entries with a user ({', '.join(users)}) need an ssh-based "
                    "runner; use --launcher pdsh or ssh, or configure the user in ~/.ssh/config"
                )
            slot_specific = {h: s for h, s in ctx.world_info.items() if s != list(range(len(s)))}
            if slot_specific:
                detail = ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in slot_specific.items())
                raise LauncherError(
                    f"--launcher {self.name} places ranks by count and cannot honour slot-specific "
                    f"{ctx.filtered_by or 'filters'} ({detail}); filter whole hosts (e.g. -i host1@host2) or use "
                    "--launcher pdsh or ssh"
                )

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """The command(s) the launcher runs locally to start the job."""
        raise NotImplementedError(f"runner {self.name!r} does not build commands")

    def cleanup_commands(self, ctx: RunnerContext) -> list[list[str]]:
        """Commands run after an interrupted or failed job to stop leftovers on remote hosts."""
        return []

    def processes(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """Per-rank layout (host, rank, local rank, environment, argv as run on the host)."""
        out: list[ProcessSpec] = []
        for node_rank in range(len(ctx.world_info)):
            out += build_rank_processes(
                ctx.world_info,
                node_rank,
                master_addr=ctx.master_addr,
                master_port=ctx.master_port,
                script=ctx.script,
                script_args=ctx.script_args,
                python=ctx.python,
                module=ctx.module,
                no_python=ctx.no_python,
                no_local_rank=ctx.no_local_rank or not self.passes_local_rank,
                visible_devices_vars=ctx.visible_devices_vars if self.uses_shell else (),
                bind_cores_to_rank=False,
                environ={},
            )
        return out

    # ----------------------------------------------------------------- helpers
    def _uniform_slots(self, ctx: RunnerContext) -> int:
        counts = {h: len(s) for h, s in ctx.world_info.items()}
        if len(set(counts.values())) != 1:
            detail = ", ".join(f"{h}={n}" for h, n in counts.items())
            raise LauncherError(
                f"--launcher {self.name} needs the same number of slots on every host, got {detail}; use "
                "--num_gpus N, fix the hostfile, or use --launcher pdsh, ssh or openmpi"
            )
        return next(iter(counts.values()))

    def _mpi_rank_argv(self, ctx: RunnerContext) -> list[str]:
        # --venv_script: sourced by a POSIX shell on the node right before the rank (no remote shell here)
        argv = ["/bin/sh", "-c", '. "$0" && exec "$@"', ctx.venv_script] if ctx.venv_script else []
        argv += [ctx.python, "-u", "-m", NODE_MODULE, "--mpi", f"--master_addr={ctx.master_addr}"]
        argv += [f"--master_port={ctx.master_port}"]
        argv += [f"--expand_env={v.name}" for v in ctx.exports if v.expand]
        argv += ["--module"] * ctx.module + ["--no_python"] * ctx.no_python
        return argv + [ctx.script, *ctx.script_args]

    def _node_argv(self, ctx: RunnerContext, node_rank: str) -> list[str]:
        argv = [ctx.python, "-u", "-m", NODE_MODULE, f"--world_info={encode_world_info(ctx.world_info)}"]
        argv += [f"--node_rank={node_rank}", f"--master_addr={ctx.master_addr}", f"--master_port={ctx.master_port}"]
        argv += [f"--visible_devices_env={var}" for var in ctx.visible_devices_vars]
        argv += ["--module"] * ctx.module + ["--no_python"] * ctx.no_python + ["--no_local_rank"] * ctx.no_local_rank
        if ctx.each_rank_log:
            argv.append(f"--enable_each_rank_log={ctx.each_rank_log}")
        if ctx.bind_cores_to_rank:
            argv.append("--bind_cores_to_rank")
        if ctx.bind_core_list:
            argv.append(f"--bind_core_list={ctx.bind_core_list}")
        return argv

    def remote_shell_command(self, ctx: RunnerContext, node_rank: str, extra: Sequence[str] = ()) -> str:
        """The command line a remote POSIX shell runs on one host: exports, ``cd``, the node launcher.

        Every argument is quoted with :func:`shlex.quote`, so an argument with spaces stays one element
        of the rank's ``sys.argv`` and nothing is interpreted by the remote shell.
        """
        parts = [shell_export(v) + ";" for v in ctx.exports]
        parts.append(f"cd {shlex.quote(ctx.cwd)};")
        if ctx.venv_script:
            parts.append(f"source {shlex.quote(ctx.venv_script)};")
        argv = self._node_argv(ctx, node_rank) + list(extra) + [ctx.script, *ctx.script_args]
        parts.append(shlex.join(argv))
        return " ".join(parts)


class PDSHRunner(Runner):
    """``pdsh -S -f 1024 -w h1,h2 <launcher_args> '<exports; cd; node launcher --node_rank=%n ...>'``.

    ``-S`` makes pdsh exit with the largest remote exit status; ``%n`` is pdsh's node rank. Environment:
    ``PDSH_RCMD_TYPE=ssh`` and ``--ssh_port`` appended to ``PDSH_SSH_ARGS_APPEND``. pdsh's output is
    watched for a failed node (see the module docstring). After an interrupted or failed job,
    ``pkill -f`` of this job's node launchers runs on every host (DeepSpeed does the same) through pdsh
    with the same environment; the pattern starts with ``[d]`` so it never matches the clean-up command
    itself (which would kill it on a host that is also the launching host).
    """

    name = "pdsh"
    binary = "pdsh"
    uses_shell = True
    passes_local_rank = True

    @staticmethod
    def _env(ctx: RunnerContext) -> dict[str, str]:
        env = {"PDSH_RCMD_TYPE": "ssh"}
        if ctx.ssh_port:
            env["PDSH_SSH_ARGS_APPEND"] = (os.environ.get("PDSH_SSH_ARGS_APPEND", "") + f" -p {ctx.ssh_port}").strip()
        return env

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One pdsh command for all hosts."""
        targets = ",".join(ctx.target(h) for h in ctx.world_info)
        argv = ["pdsh", "-S", "-f", "1024", "-w", targets, *ctx.launcher_args, self.remote_shell_command(ctx, "%n")]
        return [
            ProcessSpec(
                argv=argv, env=self._env(ctx), host=",".join(ctx.world_info), label="pdsh", watch=parse_failure_line
            )
        ]

    def cleanup_commands(self, ctx: RunnerContext) -> list[list[str]]:
        """``env PDSH_RCMD_TYPE=ssh [PDSH_SSH_ARGS_APPEND=-p PORT] pdsh ... pkill -f '[d]score.launcher.node
        --world_info=<this job>'`` on every host (same rcmd, port and ``--launcher_args`` as the job)."""
        targets = ",".join(ctx.target(h) for h in ctx.world_info)
        pattern = f"[{NODE_MODULE[0]}]{NODE_MODULE[1:]} --world_info={encode_world_info(ctx.world_info)}"
        env = [f"{k}={v}" for k, v in self._env(ctx).items()]
        return [["env", *env, "pdsh", "-f", "1024", "-w", targets, *ctx.launcher_args, f"pkill -f {shlex.quote(pattern)}"]]


class SSHRunner(Runner):
    """One ``ssh -o BatchMode=yes [-p port] <launcher_args> host '<exports; cd; node launcher>'`` per host.

    Not in DeepSpeed. The ssh processes are supervised like local ranks (one failing stops the others),
    and each gets a pipe as stdin that closes when the launcher dies; the node launcher's
    ``--stdin_watchdog`` then stops that host's ranks, so a killed launcher leaves nothing running.
    """

    name = "ssh"
    binary = "ssh"
    uses_shell = True
    passes_local_rank = True

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One ssh command per host, node rank = host index."""
        out = []
        for node_rank, host in enumerate(ctx.world_info):
            argv = ["ssh", "-o", "BatchMode=yes"]
            if ctx.ssh_port:
                argv += ["-p", str(ctx.ssh_port)]
            argv += [*ctx.launcher_args, ctx.target(host)]
            argv.append(self.remote_shell_command(ctx, str(node_rank), extra=["--stdin_watchdog"]))
            out.append(
                ProcessSpec(argv=argv, env={}, rank=node_rank, host=host, label=f"node {host} (ssh)", stdin="pipe")
            )
        return out


class OpenMPIRunner(Runner):
    """``mpirun -n N --host h1:k1,h2:k2 --mca btl ^openib --mca btl_tcp_if_include eth0 <args> -x K=V ... <rank>``.

    DeepSpeed passes ``-hostfile`` (so it must reject include/exclude); dscore passes the filtered hosts
    with ``--host`` and so honours host-level filters. The ``btl_tcp_if_include`` pair is left out when
    ``--launcher_args`` sets it. ``UCX_TLS=tcp`` is always exported (as DeepSpeed does).
    """

    name = "openmpi"
    binary = "mpirun"
    programs: tuple[str, ...] = ("mpirun.openmpi", "mpiexec.openmpi", "orterun", "mpirun")
    flavour_marker = "Open MPI|OpenRTE"

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One mpirun command."""
        hosts = ",".join(f"{h}:{len(s)}" for h, s in ctx.world_info.items())
        argv = [self.program(), "-n", str(ctx.world_size), "--host", hosts, "--mca", "btl", "^openib"]
        if "btl_tcp_if_include" not in " ".join(ctx.launcher_args):
            argv += ["--mca", "btl_tcp_if_include", "eth0"]
        argv += ctx.launcher_args
        if ctx.ssh_port and "plm_rsh_args" not in " ".join(ctx.launcher_args):
            argv += ["--mca", "plm_rsh_args", f"-p {ctx.ssh_port}"]  # how mpirun starts its daemons
        argv += ["-x", "UCX_TLS=tcp"]
        for var in ctx.exports:
            argv += ["-x", f"{var.name}={var.value}"]
        argv += self._mpi_rank_argv(ctx)
        return [ProcessSpec(argv=argv, env={}, host=",".join(ctx.world_info), label="mpirun (openmpi)", watch=parse_failure_line)]


class MPICHRunner(Runner):
    """``mpirun -n N -ppn k <args> -genv K V ... -genv MASTER_ADDR a ... -hosts h1,h2 <rank>``; equal slots."""

    name = "mpich"
    binary = "mpirun"
    programs: tuple[str, ...] = ("mpiexec.hydra", "mpirun.mpich", "mpiexec.mpich", "mpirun")
    flavour_marker = "HYDRA"

    def validate(self, ctx: RunnerContext) -> None:
        """Also requires equal slot counts (DeepSpeed: "MPICH requires same number of devices per node")."""
        super().validate(ctx)
        self._uniform_slots(ctx)

    @staticmethod
    def _hydra_env(ctx: RunnerContext) -> dict[str, str]:
        """``--ssh_port`` for hydra-based ``mpirun``s: extra arguments of the ssh launcher."""
        if not ctx.ssh_port:
            return {}
        extra = (os.environ.get("HYDRA_LAUNCHER_EXTRA_ARGS", "") + f" -p {ctx.ssh_port}").strip()
        return {"HYDRA_LAUNCHER_EXTRA_ARGS": extra}

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One mpirun command."""
        per_node = self._uniform_slots(ctx)
        argv = [self.program(), "-n", str(ctx.world_size), "-ppn", str(per_node), *ctx.launcher_args]
        for var in ctx.exports:
            argv += ["-genv", var.name, var.value]
        for name, value in (
            ("MASTER_ADDR", ctx.master_addr),
            ("MASTER_PORT", str(ctx.master_port)),
            ("WORLD_SIZE", str(ctx.world_size)),
            ("LOCAL_SIZE", str(per_node)),
        ):
            argv += ["-genv", name, value]
        argv += ["-hosts", ",".join(ctx.world_info), *self._mpi_rank_argv(ctx)]
        return [
            ProcessSpec(
                argv=argv, env=self._hydra_env(ctx), host=",".join(ctx.world_info), label="mpirun (mpich)",
                watch=parse_failure_line,
            )
        ]


class IMPIRunner(MPICHRunner):
    """Intel MPI MPMD form: ``mpirun -ppn k <args> -genv ... -genv I_MPI_PIN 0 -hosts h1,h2
    -n 1 -env RANK 0 -env LOCAL_RANK 0 python -u script args : -n 1 -env RANK 1 ...``; equal slots."""

    name = "impi"
    programs = ("mpirun",)
    flavour_marker = "Intel"

    def validate(self, ctx: RunnerContext) -> None:
        """Also rejects ``$NAME`` references: the MPMD form starts the script without dscore's node entry."""
        super().validate(ctx)
        if ctx.venv_script:
            raise LauncherError(
                "--launcher impi starts the script directly (MPMD form), so --venv_script cannot be sourced on the "
                "nodes; activate the environment before dscore run (Intel MPI passes it on) or use another launcher"
            )
        expand = [v.name for v in ctx.exports if v.expand]
        if expand:
            raise LauncherError(
                f"--launcher impi: exported variable(s) {', '.join(expand)} contain $NAME references, which "
                "impi cannot expand on the nodes (it starts the script directly); write the value literally or "
                "use another launcher"
            )

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One mpirun command with one MPMD section per rank."""
        per_node = self._uniform_slots(ctx)
        argv = ["mpirun", "-ppn", str(per_node), *ctx.launcher_args]
        for var in ctx.exports:
            argv += ["-genv", var.name, var.value]
        for name, value in (
            ("MASTER_ADDR", ctx.master_addr),
            ("MASTER_PORT", str(ctx.master_port)),
            ("WORLD_SIZE", str(ctx.world_size)),
            ("LOCAL_SIZE", str(per_node)),
            ("I_MPI_PIN", "0"),
        ):
            argv += ["-genv", name, value]
        argv += ["-hosts", ",".join(ctx.world_info)]
        user = [] if ctx.no_python else [ctx.python, "-u"] + ["-m"] * ctx.module
        for rank in range(ctx.world_size):
            if rank:
                argv.append(":")
            argv += ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_node)]
            argv += [*user, ctx.script, *ctx.script_args]
        return [ProcessSpec(argv=argv, env=self._hydra_env(ctx), host=",".join(ctx.world_info), label="mpirun (impi)")]


class MVAPICHRunner(MPICHRunner):
    """``mpirun -np N -ppn k -hosts h1,h2 <args> -env MV2_... -env K V ... <rank>``; equal slots.

    DeepSpeed writes the host list to ``/tmp/deepspeed_mvapich_hostfile`` and leaves it there; dscore
    passes ``-hosts`` so nothing is left behind.
    """

    name = "mvapich"
    programs = ("mpirun",)
    flavour_marker = ""

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One mpirun command."""
        per_node = self._uniform_slots(ctx)
        argv = ["mpirun", "-np", str(ctx.world_size), "-ppn", str(per_node), "-hosts", ",".join(ctx.world_info)]
        argv += ctx.launcher_args
        defaults = list(MVAPICH_DEFAULT_ENV) + (
            [("MV2_USE_CUDA", "1")] if "CUDA_VISIBLE_DEVICES" in ctx.visible_devices_vars else []
        )
        for name, value in defaults + [(v.name, v.value) for v in ctx.exports]:
            argv += ["-env", name, value]
        argv += self._mpi_rank_argv(ctx)
        return [
            ProcessSpec(
                argv=argv, env=self._hydra_env(ctx), host=",".join(ctx.world_info), label="mpirun (mvapich)",
                watch=parse_failure_line,
            )
        ]


class SlurmRunner(MPICHRunner):
    """``srun -n N <args> --nodelist h1,h2 --nodes M --ntasks-per-node k --export=ALL <rank>``; equal slots.

    The exported variables go through srun's own environment (``--export=ALL``) instead of
    ``--export=ALL,K=V`` as in DeepSpeed, because srun splits that list on commas and would cut values
    such as ``--opt=1,--mode=fast``.
    """

    name = "slurm"
    binary = "srun"
    programs = ("srun",)
    flavour_marker = ""

    def validate(self, ctx: RunnerContext) -> None:
        """Also refuses ``--ssh_port`` (srun reaches the nodes through slurmd, not ssh)."""
        super().validate(ctx)
        if ctx.ssh_port:
            raise LauncherError(
                f"--launcher slurm does not use ssh (srun starts the ranks through slurmd), so --ssh_port "
                f"{ctx.ssh_port} cannot apply; drop it"
            )

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One srun command."""
        per_node = self._uniform_slots(ctx)
        argv = ["srun", "-n", str(ctx.world_size), *ctx.launcher_args, "--nodelist", ",".join(ctx.world_info)]
        argv += ["--nodes", str(len(ctx.world_info)), "--ntasks-per-node", str(per_node), "--export=ALL"]
        if not any(a.startswith(("--kill-on-bad-exit", "-K")) for a in ctx.launcher_args):
            argv.append("--kill-on-bad-exit=1")  # a failed rank ends the step (srun's default lets others run on)
        argv += self._mpi_rank_argv(ctx)
        env = {v.name: v.value for v in ctx.exports}
        env.update({"MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port)})
        return [ProcessSpec(argv=argv, env=env, host=",".join(ctx.world_info), label="srun (slurm)", watch=parse_failure_line)]


#: name -> runner class, in the order ``--launcher`` lists them.
RUNNERS: dict[str, type[Runner]] = {
    r.name: r for r in (PDSHRunner, SSHRunner, OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner)
}


def check_program(runner: Runner, program: str) -> str:
    """Check that ``program`` exists and, for a generic name, is the runner's MPI flavour.

    Returns:
        A description for the log (``"/usr/bin/mpirun.openmpi (Open MPI 4.1.4)"``).

    Raises:
        LauncherError: not on ``PATH``, or ``mpirun --version`` names another flavour.
    """
    import re

    path = shutil.which(program)
    if path is None:
        tried = ", ".join(runner.programs or (program,))
        what = f"one of {tried}, none of which is" if len(runner.programs) > 1 else f"{program!r}, which is not"
        raise LauncherError(
            f"--launcher {runner.name} needs {what} on PATH; install it or choose another launcher "
            f"({', '.join(RUNNERS)}), or --no_ssh on each node"
        )
    if not runner.flavour_marker:
        return path
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL
        )
        version = (out.stdout + out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"<{program} --version failed: {exc}>"
    if not re.search(runner.flavour_marker, version):
        first = version.splitlines()[0] if version else "(no output)"
        raise LauncherError(
            f"--launcher {runner.name}: {path} is not {runner.name} ({program} --version says {first!r}) and none of "
            f"{', '.join(runner.programs[:-1])} is on PATH; install {runner.name} or choose the launcher matching "
            "your mpirun"
        )
    first = version.splitlines()[0] if version else ""
    return f"{path} ({first})" if first else path


def get_runner(name: str) -> Runner:
    """The runner called ``name`` (case-insensitive).

    Raises:
        LauncherError: unknown name, listing the valid choices.
    """
    cls = RUNNERS.get(name.lower())
    if cls is None:
        raise LauncherError(f"--launcher {name!r} is not a known launcher; choose one of {', '.join(RUNNERS)}")
    return cls()
