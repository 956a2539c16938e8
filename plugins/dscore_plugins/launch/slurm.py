"""The ``slurm`` back end: one ``srun`` starts every rank through slurmd.

Ranks read their rank from the Slurm variables (``python -m dscore.launcher.node --mpi``); placement is by
count with equal slots per host, as for the MPI back ends. ``srun`` gets ``--kill-on-bad-exit=1`` unless
``--launcher_args`` sets it, and its output is watched for the per-rank entry's failure line, since ``srun``
reports the code of the ranks it terminated rather than the failed one's.
"""

from __future__ import annotations

from dscore.errors import LauncherError
from dscore.launcher.node import parse_failure_line
from dscore.launcher.ranks import ProcessSpec
from dscore.launcher.runners import Runner, RunnerContext

__all__ = ["SlurmRunner"]


class SlurmRunner(Runner):
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
        """Also requires equal slot counts and refuses ``--ssh_port`` (srun reaches the nodes through slurmd,
        not ssh)."""
        super().validate(ctx)
        self.uniform_slots(ctx)
        if ctx.ssh_port:
            raise LauncherError(
                f"--launcher slurm does not use ssh (srun starts the ranks through slurmd), so --ssh_port "
                f"{ctx.ssh_port} cannot apply; drop it"
            )

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """One srun command."""
        per_node = self.uniform_slots(ctx)
        argv = ["srun", "-n", str(ctx.world_size), *ctx.launcher_args, "--nodelist", ",".join(ctx.world_info)]
        argv += ["--nodes", str(len(ctx.world_info)), "--ntasks-per-node", str(per_node), "--export=ALL"]
        if not any(a.startswith(("--kill-on-bad-exit", "-K")) for a in ctx.launcher_args):
            argv.append("--kill-on-bad-exit=1")  # a failed rank ends the step (srun's default lets others run on)
        argv += self.mpi_rank_argv(ctx)
        env = {v.name: v.value for v in ctx.exports}
        env.update({"MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port)})
        return [ProcessSpec(argv=argv, env=env, host=",".join(ctx.world_info), label="srun (slurm)", watch=parse_failure_line)]
