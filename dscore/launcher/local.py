"""The local launch path: start one node's ranks in this process and supervise them.

The names live in one module per concept and are re-exported here, where ``dscore run``, the per-node
launcher and user code have always imported them:

* :mod:`dscore.launcher.ranks` - a node's ranks (:class:`ProcessSpec`, :func:`build_rank_processes`,
  :func:`rank_layout`, ``--bind_cores_to_rank``'s :func:`parse_range_list` and numactl check);
* :mod:`dscore.launcher.supervise` - start and supervise processes (:func:`supervise`, the subreaper,
  ``--save_pid``'s :class:`PidFile`, :data:`TERMINATE_GRACE_S`);
* :mod:`dscore.launcher.ports` - the single-node rendezvous port (:func:`pick_master_port`,
  :func:`check_master_port`, :func:`port_holder`).
"""

from __future__ import annotations

from dscore.launcher.ports import check_master_port, pick_master_port, port_holder
from dscore.launcher.ranks import (
    ProcessSpec,
    build_rank_processes,
    check_core_binding_tool,
    parse_range_list,
    rank_layout,
)
from dscore.launcher.supervise import TERMINATE_GRACE_S, PidFile, become_subreaper, supervise

__all__ = [
    "TERMINATE_GRACE_S",
    "ProcessSpec",
    "build_rank_processes",
    "rank_layout",
    "parse_range_list",
    "supervise",
    "become_subreaper",
    "check_core_binding_tool",
    "PidFile",
    "check_master_port",
    "pick_master_port",
    "port_holder",
]
