"""Manifest: registers the ``localsh`` launcher back end (torch-free: specs only)."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import LauncherSpec

__all__ = ["dscore_register_launchers"]


@hookimpl
def dscore_register_launchers() -> list[LauncherSpec]:
    """Register ``localsh`` (not the default: pdsh stays the back end used without ``--launcher``)."""
    return [
        LauncherSpec(
            name="localsh",
            runner="dscore_example_launcher.runner:LocalShellRunner",
            executables=("bash",),
            description="runs every host's node launcher on this machine from a shell script it writes per host",
        )
    ]
