"""The ``shm`` comm transport: same-host payloads of the gloo pairwise collectives through shared memory.

One concept per module:

* :mod:`~dscore_plugins.comm.shm.segments` — the sealed ``memfd`` segments a rank owns and the read-only
  maps of its peers';
* :mod:`~dscore_plugins.comm.shm.channel` — :class:`ShmChannel`: numbered exchanges over those segments,
  their memory ordering (the ``shm_sync`` op) and failure handling;
* :mod:`~dscore_plugins.comm.shm.bootstrap` — :func:`channel_for`: whether a group gets a channel
  (collective, on its first use) and the descriptors' hand-over; :func:`flush_pending_sends`;
* :mod:`~dscore_plugins.comm.shm.transport` — :class:`ShmTransport`, the transport the facade runs
  collectives on;
* :mod:`~dscore_plugins.comm.shm.builder` — the ``shm_sync`` op builder (``csrc/comm/shm_sync.cpp``).

``DSCORE_SHM=0`` (or ``comm_transport:shm`` / ``op_builder:shm_sync`` disabled) keeps every payload on gloo.
"""

from __future__ import annotations

from dscore_plugins.comm.shm.bootstrap import channel_for, flush_pending_sends, shm_enabled
from dscore_plugins.comm.shm.channel import Exchange, ShmChannel
from dscore_plugins.comm.shm.transport import ShmTransport

__all__ = ["Exchange", "ShmChannel", "ShmTransport", "channel_for", "flush_pending_sends", "shm_enabled"]
