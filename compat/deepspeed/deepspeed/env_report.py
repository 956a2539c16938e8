"""``ds_report``: dscore's environment report (``dscore report``), which also says that this compatibility
layer is the installed ``deepspeed``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["cli_main", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Print ``dscore report`` (``--json`` for JSON); returns 0."""
    from dscore.env_report import main as report_main

    return report_main(argv)


def cli_main() -> int:
    """The ``ds_report`` console script."""
    return main(sys.argv[1:])
