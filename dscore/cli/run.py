"""``dscore run [launcher options] user_script [user args]``: DeepSpeed's ``deepspeed`` launcher.

Same options with the same meaning as ``deepspeed`` (see :mod:`dscore.launcher.options`), plus
``--dry_run [--json]`` to print the plan (world info, every rank's environment and argv, the exact
commands) without starting anything. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import logging

from dscore.launcher.options import add_arguments as _add_launcher_arguments

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the launcher options and the ``user_script``/``user_args`` positionals."""
    _add_launcher_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Build the plan; print it with ``--dry_run``, else run it and return the job's exit code.

    Raises:
        HostfileError, LauncherError: bad input (the CLI prints the message and exits 2).
    """
    from dscore.launcher.plan import build_plan, dumps, execute, format_plan

    level = "error" if args.quiet else args.log_level
    logging.getLogger("dscore").setLevel(level.upper())
    plan = build_plan(args)
    if args.dry_run:
        print(dumps(plan) if args.json else format_plan(plan))
        return 0
    return execute(plan)
