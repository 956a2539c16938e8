"""The ``mpirun`` back ends: ``openmpi``, ``mpich``, ``impi`` and ``mvapich``.

``mpirun`` starts every rank and passes the environment as arguments; the ranks read their rank from the
MPI variables through ``python -m dscore.launcher.node --mpi`` (``impi``'s MPMD form sets ``RANK`` /
``LOCAL_RANK`` per rank and starts the script directly). Ranks are placed by count, so host-level
include/exclude/``--num_nodes`` are honoured but filters that pick particular slots are refused, and
(except openmpi) so are uneven slot counts. ``user@host`` entries need an ssh-based back end.

Which program: Debian-like systems install Open MPI and MPICH side by side, and plain ``mpirun`` is
whichever the alternatives system picked. So openmpi looks for ``mpirun.openmpi``, ``mpiexec.openmpi``,
``orterun`` and mpich for ``mpiexec.hydra``, ``mpirun.mpich``, ``mpiexec.mpich`` first, falling back to
``mpirun``, whose ``--version`` must then name the right flavour
(:func:`dscore.launcher.runners.check_program`, before anything starts).

``--ssh_port``: openmpi passes ``--mca plm_rsh_args "-p N"`` (how mpirun starts its daemons), the hydra-based
``mpirun`` of mpich, impi and mvapich gets ``HYDRA_LAUNCHER_EXTRA_ARGS``. The output of ``mpirun`` is watched
for the per-rank entry's failure line (except impi), and the job stops with the failed rank's code: Open
MPI's ``mpirun`` would end the job itself, but MPICH's hydra waits for every non-MPI process.
"""

from __future__ import annotations

import os

from dscore.errors import LauncherError
from dscore.launcher.node import parse_failure_line
from dscore.launcher.ranks import ProcessSpec
from dscore.launcher.runners import Runner, RunnerContext

__all__ = ["IMPIRunner", "MPICHRunner", "MVAPICHRunner", "MVAPICH_DEFAULT_ENV", "OpenMPIRunner"]

#: DeepSpeed's MVAPICH defaults (``MV2_USE_CUDA=1`` is added for accelerators with a visible-devices variable).
MVAPICH_DEFAULT_ENV: tuple[tuple[str, str], ...] = (
    ("MV2_SMP_USE_CMA", "0"),
    ("MV2_DEBUG_SHOW_BACKTRACE", "1"),
    ("MV2_SUPPORT_DL", "1"),
    ("MV2_ENABLE_AFFINITY", "0"),
    ("MV2_INTER_ALLGATHER_TUNING", "5"),
    ("MV2_CUDA_USE_NAIVE", "0"),
)


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
        argv += self.mpi_rank_argv(ctx)
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
        self.uniform_slots(ctx)

    @staticmethod
    def _hydra_env(ctx: RunnerContext) -> dict[str, str]:
        """``--ssh_port`` for hydra-based ``mpirun``s: extra arguments of the ssh launcher."""
        if not ctx.ssh_port:
            return {}
        extra = (os.environ.get("HYDRA_LAUNCHER_EXTRA_ARGS", "") + f" -p {ctx.ssh_port}").strip()
        return {"HYDRA_LAUNCHER_EXTRA_ARGS": extra}

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One mpirun command."""
        per_node = self.uniform_slots(ctx)
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
        argv += ["-hosts", ",".join(ctx.world_info), *self.mpi_rank_argv(ctx)]
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
        per_node = self.uniform_slots(ctx)
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
        per_node = self.uniform_slots(ctx)
        argv = ["mpirun", "-np", str(ctx.world_size), "-ppn", str(per_node), "-hosts", ",".join(ctx.world_info)]
        argv += ctx.launcher_args
        defaults = list(MVAPICH_DEFAULT_ENV) + (
            [("MV2_USE_CUDA", "1")] if "CUDA_VISIBLE_DEVICES" in ctx.visible_devices_vars else []
        )
        for name, value in defaults + [(v.name, v.value) for v in ctx.exports]:
            argv += ["-env", name, value]
        argv += self.mpi_rank_argv(ctx)
        return [
            ProcessSpec(
                argv=argv, env=self._hydra_env(ctx), host=",".join(ctx.world_info), label="mpirun (mvapich)",
                watch=parse_failure_line,
            )
        ]
