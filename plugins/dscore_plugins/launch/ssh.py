"""The ``ssh`` back end (dscore's own): one ``ssh`` connection per host, supervised like local ranks.

A failing host stops the other hosts' connections, which ends their node launchers (``--stdin_watchdog``:
each connection's stdin is a pipe that closes when ``dscore run`` dies, however it dies).
"""

from __future__ import annotations

from dscore.launcher.ranks import ProcessSpec
from dscore.launcher.runners import Runner, RunnerContext

__all__ = ["SSHRunner"]


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
