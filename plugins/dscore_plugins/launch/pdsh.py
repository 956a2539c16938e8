"""The ``pdsh`` back end (DeepSpeed's default): one ``pdsh -S`` command starts the node launcher on every host.

``pdsh -S`` only returns after every node's command ended, so its output is watched for a node launcher's
failure line (:func:`dscore.launcher.node.parse_failure_line`) or pdsh's ``ssh exited with exit code N``;
on the first one the job is stopped and the clean-up command (``pkill`` of this job's node launchers on
every host, through pdsh with the same rcmd type and ``--ssh_port``) runs, and ``dscore run`` exits with the
failed rank's code.
"""

from __future__ import annotations

import os
import shlex

from dscore.launcher.node import encode_world_info, parse_failure_line
from dscore.launcher.ranks import ProcessSpec
from dscore.launcher.runners import NODE_MODULE, Runner, RunnerContext

__all__ = ["PDSHRunner"]


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
