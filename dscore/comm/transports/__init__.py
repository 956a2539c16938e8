"""The transports :class:`dscore.comm.Comm` runs a collective on, one module each, behind one interface.

* :mod:`~dscore.comm.transports.native` — the backend's own collectives (``torch.distributed``: NCCL,
  gloo, any registered backend) with exact emulations of what a backend lacks (each
  :class:`~dscore.comm.Comm` holds one, :attr:`Comm.native`, since the emulations it falls back to are
  its own); the default (:func:`pick` returns None), and the only one a device tensor ever takes.
* :mod:`~dscore.comm.transports.p2p` — gloo point-to-point: all-gathers and sum/average reduce-scatters as
  pairwise ``isend``/``irecv`` exchanges (CPU tensors on gloo).
* :mod:`~dscore.comm.transports.shm` — same-host shared memory (:mod:`dscore.comm.shm`): those exchanges
  and sum/average all-reduces without TCP, when every rank of the group is on this host.

:func:`pick` makes the choice for one call; each transport offers the same operations
(:class:`Transport`).
"""

from __future__ import annotations

from dscore.comm.transports.base import Transport, pick

__all__ = ["Transport", "flush_pending_sends", "pick"]


def flush_pending_sends(timeout: float = 60.0) -> int:
    """Deliver what peers may still wait for, on every transport (``timeout`` seconds for each): the
    shared-memory channels' gloo sends (:func:`dscore.comm.shm.flush_pending_sends`) and the gloo
    point-to-point transfers of works dropped unwaited (:func:`~dscore.comm.transports.p2p.flush_dropped`).
    Run before a process group is destroyed and at exit. Returns the transfers left undelivered."""
    from dscore.comm.shm import flush_pending_sends as flush_shm
    from dscore.comm.transports.p2p import flush_dropped

    return flush_shm(timeout) + flush_dropped(timeout)
