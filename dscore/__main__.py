"""``python -m dscore`` is the same as the ``dscore`` command."""

from __future__ import annotations

import sys

from dscore.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
