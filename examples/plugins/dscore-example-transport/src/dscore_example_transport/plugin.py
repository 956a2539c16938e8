"""Manifest (torch-free): the ``counting`` comm transport."""

from __future__ import annotations

from dscore.protocols import hookimpl
from dscore.specs import CommTransportSpec


@hookimpl
def dscore_register_comm_transports() -> list[CommTransportSpec]:
    """The ``counting`` transport, asked before the built-ins (``shm`` 200, ``p2p`` 100)."""
    return [
        CommTransportSpec(
            name="counting",
            factory="dscore_example_transport.transport:make_transport",
            priority=1000,
            description="counts the bytes of every collective, then runs it where it would have run",
        )
    ]
