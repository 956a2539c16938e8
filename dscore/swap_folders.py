"""Where NVMe-offload swap files live, and how stale ones are found (torch-free; used by ``dscore report``).

NVMe offload (``zero_optimization.offload_optimizer`` / ``offload_param`` with ``device: "nvme"``) writes
swap files under ``<nvme_path>/dscore-swap-<run id>/rank<N>/``. Each rank folder holds
``owner.json`` (``pid``, ``host``, ``run_id``, ``created``); the process removes its folder on
``engine.close()``, at interpreter exit and when a run fails with an exception. A folder survives only
when its process was killed (SIGKILL, OOM killer, power loss): then its owner pid is gone.

Where ``dscore report`` looks: every ``nvme_path`` a ZeRO stage has used on this machine is appended
(once) to the *swap index*, a text file of absolute paths, one per line: ``$DSCORE_SWAP_INDEX`` when
set, else ``~/.cache/dscore/swap_roots``. A rank folder under one of those paths is *stale* when its
``owner.json`` names this host and a pid that no longer runs, or when it has no readable
``owner.json`` at all. Folders of other hosts (shared file systems) are never called stale.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

__all__ = [
    "OWNER_FILE",
    "SWAP_DIR_PREFIX",
    "SWAP_INDEX_ENV",
    "find_stale_swap_folders",
    "record_swap_root",
    "swap_index_path",
    "swap_roots",
]

#: Name prefix of per-run swap folders (``<nvme_path>/dscore-swap-<run id>``).
SWAP_DIR_PREFIX = "dscore-swap-"
#: The marker file of a rank folder (JSON: pid, host, run_id, created).
OWNER_FILE = "owner.json"
#: Environment variable naming the swap index file (default ``~/.cache/dscore/swap_roots``).
SWAP_INDEX_ENV = "DSCORE_SWAP_INDEX"


def swap_index_path() -> Path:
    """The swap index file: ``$DSCORE_SWAP_INDEX`` or ``~/.cache/dscore/swap_roots``."""
    env = os.environ.get(SWAP_INDEX_ENV)
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "dscore" / "swap_roots"


def swap_roots() -> list[Path]:
    """The ``nvme_path`` folders recorded in the swap index (existing or not), in recording order."""
    try:
        lines = swap_index_path().read_text().splitlines()
    except OSError:
        return []
    return [Path(line) for line in dict.fromkeys(s.strip() for s in lines) if line]


def record_swap_root(folder: str | os.PathLike[str]) -> None:
    """Add ``folder`` (an ``nvme_path``) to the swap index unless it is there; best effort, never raises
    (a read-only home only costs ``dscore report`` the ability to find that folder's leftovers)."""
    root = str(Path(folder).resolve())
    try:
        if root in {str(p) for p in swap_roots()}:
            return
        index = swap_index_path()
        index.parent.mkdir(parents=True, exist_ok=True)
        with open(index, "a", encoding="utf-8") as f:
            f.write(root + "\n")
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_stale_swap_folders(folders: list[str | os.PathLike[str]] | str | os.PathLike[str] | None = None) -> list[Path]:
    """Rank folders under ``folders``' ``dscore-swap-*`` run folders left by processes no longer running
    on this host; never raises for unreadable entries.

    Args:
        folders: one ``nvme_path`` or several; ``None``: every path in the swap index.

    Returns:
        The stale ``.../dscore-swap-<run>/rank<N>`` folders, sorted.
    """
    if folders is None:
        roots = swap_roots()
    elif isinstance(folders, str | os.PathLike):
        roots = [Path(folders)]
    else:
        roots = [Path(f) for f in folders]
    host = socket.gethostname()
    stale: list[Path] = []
    for root in roots:
        if not root.is_dir():
            continue
        try:
            runs = sorted(root.glob(SWAP_DIR_PREFIX + "*"))
        except OSError:
            continue
        for run in runs:
            try:
                rank_dirs = sorted(run.glob("rank*"))
            except OSError:
                continue
            for rank_dir in rank_dirs:
                try:
                    owner = json.loads((rank_dir / OWNER_FILE).read_text())
                    pid = int(owner.get("pid", 0))
                except (OSError, ValueError, TypeError, AttributeError):
                    stale.append(rank_dir)  # no owner record: nothing can be using it
                    continue
                if owner.get("host") == host and not _pid_alive(pid):
                    stale.append(rank_dir)
    return sorted(set(stale))
