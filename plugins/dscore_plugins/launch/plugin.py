"""Manifest of the built-in launcher back ends (torch-free: specs only).

``executables`` lists, for each back end, the programs its runner tries in order (the first on ``PATH`` is
started; the last is the generic fallback), as :attr:`dscore.launcher.runners.Runner.programs` does.
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import LauncherSpec

__all__ = ["LAUNCHER_SPECS", "dscore_register_launchers"]

_PKG = "dscore_plugins.launch"

#: in the order ``dscore run --help`` lists them.
LAUNCHER_SPECS: tuple[LauncherSpec, ...] = (
    LauncherSpec(
        name="pdsh",
        runner=f"{_PKG}.pdsh:PDSHRunner",
        executables=("pdsh",),
        default=True,
        description="pdsh -S over ssh starts the node launcher on every host (DeepSpeed's default)",
    ),
    LauncherSpec(
        name="ssh",
        runner=f"{_PKG}.ssh:SSHRunner",
        executables=("ssh",),
        description="one ssh connection per host, supervised like local ranks",
    ),
    LauncherSpec(
        name="openmpi",
        runner=f"{_PKG}.mpi:OpenMPIRunner",
        executables=("mpirun.openmpi", "mpiexec.openmpi", "orterun", "mpirun"),
        description="Open MPI's mpirun starts every rank (--host h:k, -x K=V)",
    ),
    LauncherSpec(
        name="mpich",
        runner=f"{_PKG}.mpi:MPICHRunner",
        executables=("mpiexec.hydra", "mpirun.mpich", "mpiexec.mpich", "mpirun"),
        description="MPICH's hydra mpirun starts every rank (equal slots per host)",
    ),
    LauncherSpec(
        name="impi",
        runner=f"{_PKG}.mpi:IMPIRunner",
        executables=("mpirun",),
        description="Intel MPI's mpirun, MPMD form with RANK/LOCAL_RANK per rank (equal slots per host)",
    ),
    LauncherSpec(
        name="mvapich",
        runner=f"{_PKG}.mpi:MVAPICHRunner",
        executables=("mpirun",),
        description="MVAPICH2's mpirun with DeepSpeed's MV2_* defaults (equal slots per host)",
    ),
    LauncherSpec(
        name="slurm",
        runner=f"{_PKG}.slurm:SlurmRunner",
        executables=("srun",),
        description="srun starts every rank through slurmd (equal slots per host)",
    ),
)


@hookimpl
def dscore_register_launchers() -> list[LauncherSpec]:
    """Register pdsh (the default), ssh, openmpi, mpich, impi, mvapich and slurm."""
    return list(LAUNCHER_SPECS)
