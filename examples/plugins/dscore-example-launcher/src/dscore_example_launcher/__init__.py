"""An example third-party launcher back end for ``dscore run`` (``--launcher localsh``)."""

from __future__ import annotations

__all__: list[str] = []
