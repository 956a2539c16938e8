"""What the launcher needs from the accelerator, without importing torch when it can be avoided.

The launcher needs: the visible-devices variable(s) it sets per node (``CUDA_VISIBLE_DEVICES``,
``ZE_AFFINITY_MASK``, ...), the extra environment prefixes exported to remote nodes (``export_envs()``),
and - only when neither a hostfile nor ``--num_gpus`` nor a visible-devices variable says how many
processes to start - the local device count. Everything comes from the accelerator plugins through the
registry (:func:`dscore.plugin_manager.create_plugin_manager`, :class:`dscore.registry.Registry`).

Two modes keep ``dscore run``'s own start-up light (probing a GPU accelerator imports torch, which costs
seconds):

* **selected** - when ``DS_ACCELERATOR`` is set, or the device count or the remote exports are needed,
  :func:`dscore.accelerator.select_accelerator` picks the accelerator (DeepSpeed's order: the variable,
  then probes) and its ``visible_devices_envs()``/``export_envs()`` are used;
* **unprobed** - otherwise (a local launch whose size is known), nothing is probed: each rank gets the
  visible-devices variable of *every* installed accelerator (read from the accelerator class's
  ``visible_devices_env`` attribute; a variable of an absent device family has no effect).

When ``dscore.accelerator`` cannot be imported the launcher behaves as on CPU: no visible-devices
variable, no extra exports, one process per NUMA node with CPUs (read from ``/sys``).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dscore.errors import LauncherError

__all__ = ["AcceleratorLaunchInfo", "cpu_launch_info", "resolve_launch_info", "numa_nodes_with_cpus"]

log = logging.getLogger("dscore.launcher.accel")


def numa_nodes_with_cpus() -> int:
    """Number of NUMA nodes that have CPUs (``/sys/devices/system/node/node*/cpulist``), at least 1."""
    count = 0
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        try:
            with open(path, encoding="ascii") as fh:
                if fh.read().strip():
                    count += 1
        except OSError:
            continue
    return max(count, 1)


@dataclass
class AcceleratorLaunchInfo:
    """Launcher-facing facts about the accelerator.

    Attributes:
        name: accelerator name (``"cpu"``, ``"cuda"``), or ``"unprobed"`` in unprobed mode.
        visible_devices_vars: variables set to a node's slot ids (may be empty).
        export_prefixes: extra environment prefixes exported to remote nodes.
        reason: why (logged and shown by ``--dry_run``).
    """

    name: str
    visible_devices_vars: tuple[str, ...] = ()
    export_prefixes: tuple[str, ...] = ()
    reason: str = ""
    _accelerator: Any = field(default=None, repr=False)

    def device_count(self) -> int:
        """Local device count (the default processes per node); may import torch for device accelerators.

        Raises:
            LauncherError: no devices (DeepSpeed: "Unable to proceed, no GPU resources available").
        """
        count = int(self._accelerator.device_count()) if self._accelerator is not None else numa_nodes_with_cpus()
        if count < 1:
            raise LauncherError(
                f"accelerator {self.name!r} reports no devices; pass --num_gpus N (processes per node) or a "
                "hostfile with -H"
            )
        return count


def cpu_launch_info(reason: str) -> AcceleratorLaunchInfo:
    """The CPU fallback: no visible-devices variable, no extra exports, one process per NUMA node."""
    return AcceleratorLaunchInfo(name="cpu", reason=reason)


def resolve_launch_info(environ: Mapping[str, str] | None = None, *, probe: bool = False) -> AcceleratorLaunchInfo:
    """The accelerator facts for this launch (see the module docstring for the two modes).

    Args:
        environ: environment (``DS_ACCELERATOR``); default ``os.environ``.
        probe: True when the device count or the remote exports are needed (forces selection).

    Raises:
        AcceleratorError: ``DS_ACCELERATOR`` names an accelerator that is not installed or not usable
            (never replaced silently by CPU). A missing ``dscore.accelerator`` layer is not an error.
    """
    environ = os.environ if environ is None else environ
    try:
        from dscore.accelerator import select_accelerator
    except ImportError as exc:
        return cpu_launch_info(f"dscore.accelerator is not importable ({exc}); CPU behaviour")
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import AcceleratorSpec, resolve

    registry = Registry(create_plugin_manager(environ=dict(environ)))
    requested = environ.get("DS_ACCELERATOR", "").strip()
    if requested or probe:
        accelerator, reason = select_accelerator(registry, environ=environ)
        return AcceleratorLaunchInfo(
            name=str(accelerator.name or accelerator.device_type),
            visible_devices_vars=tuple(accelerator.visible_devices_envs()),
            export_prefixes=tuple(accelerator.export_envs()),
            reason=str(reason),
            _accelerator=accelerator,
        )
    found: list[str] = []
    for spec in sorted(registry.specs("accelerator"), key=lambda s: -getattr(s, "priority", 0)):
        assert isinstance(spec, AcceleratorSpec)
        try:
            var = getattr(resolve(spec.accelerator), "visible_devices_env", None)
        except Exception as exc:  # a broken plugin must not stop a launch that does not need it
            log.debug("accelerator %s: cannot read its visible-devices variable: %s", spec.name, exc)
            continue
        if var and var not in found:
            found.append(var)
    return AcceleratorLaunchInfo(
        name="unprobed",
        visible_devices_vars=tuple(found),
        reason="DS_ACCELERATOR unset and nothing needs probing: setting the visible-devices variable of every "
        f"installed accelerator ({', '.join(found) or 'none'})",
    )
