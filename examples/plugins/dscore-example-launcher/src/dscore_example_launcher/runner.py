"""``--launcher localsh``: every host of the hostfile is played by this machine, one shell script per host.

For each host the runner writes ``<script_dir>/node<R>-<host>.sh`` holding exactly the command a remote
shell would run there (the exported variables, ``cd``, ``python -m dscore.launcher.node --node_rank=R ...``:
:meth:`dscore.launcher.runners.Runner.remote_shell_command`) and runs it with ``bash``. A hostfile's layout
(hosts, slots, include/exclude) can so be tried on one machine before a cluster is at hand, and the
scripts stay behind as a replayable record of what each node ran.

The script is written when the job starts, by the command itself (``bash -c``), so ``--dry_run`` writes
nothing. Options, through ``--launcher_args``: ``--script_dir DIR`` (default ``<tmp>/dscore-localsh``).
Give ``--master_addr 127.0.0.1`` when the hostfile's host names do not resolve.

Only public dscore names are used: :class:`~dscore.launcher.runners.Runner` and
:class:`~dscore.launcher.runners.RunnerContext` (the back-end contract),
:class:`~dscore.launcher.ranks.ProcessSpec`, and :class:`~dscore.errors.LauncherError`.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

from dscore.errors import LauncherError
from dscore.launcher.ranks import ProcessSpec
from dscore.launcher.runners import Runner, RunnerContext

__all__ = ["LocalShellRunner", "script_path"]

#: ``bash -c`` program: write the script ($1) to its path ($0), then run it in place of this shell.
_WRITE_AND_RUN = 'mkdir -p "$(dirname "$0")" && printf "%s\\n" "$1" > "$0" && exec bash "$0"'


def _options(ctx: RunnerContext) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="--launcher localsh --launcher_args", add_help=False, allow_abbrev=False)
    parser.add_argument("--script_dir", default=os.path.join(tempfile.gettempdir(), "dscore-localsh"))
    try:
        opts, unknown = parser.parse_known_args(ctx.launcher_args)
    except SystemExit:  # argparse exits on a malformed value (``--script_dir`` without a directory)
        raise LauncherError(f"--launcher localsh: bad --launcher_args {ctx.launcher_args!r}; expected --script_dir DIR") from None
    if unknown:
        raise LauncherError(
            f"--launcher localsh does not understand --launcher_args {' '.join(unknown)!r}; it accepts --script_dir DIR"
        )
    return opts


def script_path(script_dir: str, node_rank: int, host: str) -> str:
    """Where the script of host ``host`` (node ``node_rank``) goes: ``<script_dir>/node<R>-<host>.sh``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host)
    return os.path.join(os.path.abspath(script_dir), f"node{node_rank}-{safe}.sh")


class LocalShellRunner(Runner):
    """One ``bash`` per host, on this machine, each running the script it writes for that host."""

    binary = "bash"
    uses_shell = True  # per-host visible devices, slot filters and user@host entries are honoured
    passes_local_rank = True

    def validate(self, ctx: RunnerContext) -> None:
        """Also rejects ``--launcher_args`` other than ``--script_dir DIR`` and ``--ssh_port`` (no ssh here).

        Raises:
            LauncherError: naming the option.
        """
        super().validate(ctx)
        _options(ctx)
        if ctx.ssh_port:
            raise LauncherError(f"--launcher localsh runs every host on this machine, so --ssh_port {ctx.ssh_port} cannot apply")

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """``bash -c '<write the script and run it>' <path> <script text>`` per host, node rank = host index."""
        script_dir = _options(ctx).script_dir
        out = []
        for node_rank, host in enumerate(ctx.world_info):
            path = script_path(script_dir, node_rank, host)
            text = "\n".join(
                [
                    "#!/bin/bash",
                    f"# dscore --launcher localsh: node {node_rank} ({ctx.target(host)}) of {len(ctx.world_info)}",
                    self.remote_shell_command(ctx, str(node_rank)),
                ]
            )
            out.append(
                ProcessSpec(
                    argv=[self.program(), "-c", _WRITE_AND_RUN, path, text],
                    env={},
                    rank=node_rank,
                    host=host,
                    label=f"node {host} (localsh)",
                )
            )
        return out
