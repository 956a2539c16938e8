"""Plugin-set agreement across ranks.

Ranks that run different plugins (a missing package on one host, another version) would otherwise
diverge much later, typically hanging in a collective only some ranks reach. Right after the process
group exists every rank all-gathers ``(hostname, rank, fingerprint, describe())`` of its plugin
manager; if the fingerprints differ, every rank raises the same :class:`~dscore.errors.DistributedError`
naming the hosts/ranks that differ from rank 0 and the plugins that make the difference.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from dscore.errors import DistributedError

if TYPE_CHECKING:
    from dscore.comm.facade import Comm
    from dscore.plugin_manager import DscorePluginManager

__all__ = ["PluginSetReport", "compare_plugin_sets", "verify_plugin_set"]

#: (hostname, rank, fingerprint, describe()) of one rank.
PluginSetReport = tuple[str, int, str, list[tuple[str, str, str, str]]]


def _entry_text(entry: tuple[str, str, str, str]) -> str:
    name, distribution, version, status = entry
    origin = f"{distribution} {version}".strip() or "registered object"
    return f"{name} ({origin}, {status})"


def compare_plugin_sets(reports: list[PluginSetReport]) -> str:
    """Return ``""`` when all reports share rank 0's fingerprint, else a multi-line explanation.

    Each differing rank is named with its host, and its plugin entries are compared with rank 0's:
    ``only on rank 1 (hostB): extra (mypkg 1.0, active)``, ``only on rank 0 (hostA): ...``.
    """
    if not reports:
        return ""
    reports = sorted(reports, key=lambda r: r[1])
    ref_host, ref_rank, ref_fp, ref_desc = reports[0]
    ref_set = {tuple(e) for e in ref_desc}
    lines: list[str] = []
    for host, rank, fp, desc in reports[1:]:
        if fp == ref_fp:
            continue
        mine = {tuple(e) for e in desc}
        parts = []
        extra = sorted(mine - ref_set)
        missing = sorted(ref_set - mine)
        if extra:
            parts.append(f"only on rank {rank} ({host}): " + "; ".join(_entry_text(e) for e in extra))  # type: ignore[arg-type]
        if missing:
            parts.append(f"only on rank {ref_rank} ({ref_host}): " + "; ".join(_entry_text(e) for e in missing))  # type: ignore[arg-type]
        if not parts:
            parts.append("same plugin list but a different fingerprint")
        lines.append(f"rank {rank} on {host} (fingerprint {fp}) differs from rank {ref_rank} on {ref_host} "
                     f"(fingerprint {ref_fp}): " + " | ".join(parts))
    return "\n".join(lines)


def verify_plugin_set(manager: DscorePluginManager, comm: Comm, group: Any = None) -> None:
    """Collectively compare this rank's plugin set with every other rank's; all ranks must call it.

    Raises:
        DistributedError: on every rank, when any rank's fingerprint differs from rank 0's; the message
            names each differing rank and host and the plugin entries that differ.
    """
    report: PluginSetReport = (socket.gethostname(), comm.get_rank(), manager.fingerprint(), manager.describe())
    reports = comm.all_gather_object(report, group=group)
    problem = compare_plugin_sets(list(reports))
    if problem:
        raise DistributedError(
            "ranks run different plugin sets (install the same packages and versions on every host, or "
            "disable the extra plugins with DSCORE_DISABLE_PLUGINS):\n" + problem
        )
