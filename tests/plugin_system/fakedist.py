"""Write fake installed distributions (a package + a ``*.dist-info`` with ``entry_points.txt``) into a
directory that a test puts on ``sys.path``, so discovery runs against real ``importlib.metadata``."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_distribution(root: Path, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Create ``root/<module>.py`` files and ``root/<dist>-<version>.dist-info``.

    Args:
        root: a directory that will be on ``sys.path``.
        dist: distribution name (``"dscore-fake-a"``).
        version: its version string.
        entry_points: entry-point name -> value in the ``dscore`` group.
        modules: dotted module name -> source (packages get ``__init__.py``).
    """
    for name, source in modules.items():
        parts = name.split(".")
        path = root.joinpath(*parts[:-1])
        path.mkdir(parents=True, exist_ok=True)
        for i in range(1, len(parts)):
            init = root.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                init.write_text("")
        (path / f"{parts[-1]}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[dscore]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
