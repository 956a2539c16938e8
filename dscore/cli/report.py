"""``dscore report [--json]``: versions, the selected accelerator and the op table (DeepSpeed's ``ds_report``).

Thin wrapper over :mod:`dscore.env_report`; torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the machine-readable report."""
    from dscore.env_report import add_arguments as _add

    _add(parser)


def run(args: argparse.Namespace) -> int:
    """Print the report; exits 0 even when probes fail (each failure is shown as that item's reason)."""
    from dscore.env_report import run as _run

    return _run(args)
