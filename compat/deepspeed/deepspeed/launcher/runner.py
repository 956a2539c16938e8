"""``deepspeed.launcher.runner``: the ``deepspeed`` console script is ``dscore run`` (same flags:
``--num_gpus``, ``--num_nodes``, ``--hostfile``, ``--include``/``--exclude``, ``--master_port``, the
launchers), and ``DEEPSPEED_ENVIRONMENT_NAME`` is the environment file both read (``.deepspeed_env``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dscore.launcher.envfile import ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]


def main(args: Sequence[str] | None = None) -> int:
    """``deepspeed [launcher flags] script.py [script args]`` -> ``dscore run ...``; returns its exit code."""
    from dscore.cli.main import main as dscore_main

    argv = list(sys.argv[1:] if args is None else args)
    return dscore_main(["run", *argv])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
