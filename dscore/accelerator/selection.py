"""Choosing the accelerator: the config's ``"accelerator"``, then ``DS_ACCELERATOR``, then probes.

Mirrors DeepSpeed's ``get_accelerator()`` (``accelerator/real_accelerator.py``) with three differences:
the candidates are whatever accelerator plugins are installed (not a closed list), the result is
returned to the caller instead of cached in a module global, and a requested accelerator that is not
usable here is an error instead of a silent CPU fallback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from dscore.accelerator.base import Accelerator, ProbeResult
from dscore.errors import AcceleratorError, ComponentNotFoundError, PluginError, did_you_mean
from dscore.registry import Registry
from dscore.specs import AcceleratorSpec, resolve

__all__ = ["ENV_VAR", "probe_accelerator", "select_accelerator"]

log = logging.getLogger("dscore.accelerator")

#: the environment variable DeepSpeed users already know.
ENV_VAR = "DS_ACCELERATOR"


def probe_accelerator(spec: AcceleratorSpec) -> ProbeResult:
    """Run ``spec.probe`` and return its :class:`ProbeResult`.

    A probe that cannot be imported, raises, or returns something else is reported as unavailable with
    the reason (never raised), so one broken accelerator plugin cannot stop selection.
    """
    try:
        probe = resolve(spec.probe)
        result = probe()
    except Exception as exc:  # a probe must never break selection
        return ProbeResult(False, f"probe {spec.probe!r} failed: {type(exc).__name__}: {exc}", 0)
    if not isinstance(result, ProbeResult):
        return ProbeResult(False, f"probe {spec.probe!r} returned {result!r}, not a ProbeResult", 0)
    if result.available and result.device_count < 1:
        return ProbeResult(False, f"{result.reason}; but it reports 0 devices", 0)
    return result


def _instantiate(spec: AcceleratorSpec) -> Accelerator:
    try:
        cls = resolve(spec.accelerator)
        accelerator = cls()
    except Exception as exc:
        raise AcceleratorError(
            f"accelerator {spec.name!r}: cannot create {spec.accelerator!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(accelerator, Accelerator):
        raise AcceleratorError(
            f"accelerator {spec.name!r}: {spec.accelerator!r} made a {type(accelerator).__name__}, which is not a "
            "dscore.accelerator.Accelerator subclass"
        )
    return accelerator


def _requested_spec(registry: Registry, name: str, origin: str) -> AcceleratorSpec:
    try:
        spec = registry.get_typed(AcceleratorSpec, name, config_path=origin)
    except ComponentNotFoundError as exc:
        installed = registry.names("accelerator")
        close = did_you_mean(name, installed)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise AcceleratorError(
            f"{origin}={name!r} names no installed accelerator. Installed accelerators: "
            f"{', '.join(installed) or '(none)'}.{hint}"
        ) from exc
    except PluginError as exc:  # conflict or broken provider: keep the registry's full message
        raise AcceleratorError(f"{origin}={name!r}: {exc}") from exc
    return spec


def select_accelerator(
    registry: Registry,
    requested: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Accelerator, str]:
    """Pick and instantiate the accelerator for this process.

    Order: ``requested`` (the config's ``"accelerator"`` key), then ``DS_ACCELERATOR`` in ``environ``
    (default ``os.environ``), then every installed accelerator's probe by descending ``priority``
    (ties by name); ``cpu`` (lowest priority, always available) is the fallback. The decision and its
    reason are logged once at INFO.

    Args:
        registry: the registry of the runtime's plugin manager.
        requested: an accelerator name or alias (case-insensitive), or ``None``/``""`` for automatic.
        environ: environment to read ``DS_ACCELERATOR`` from.

    Returns:
        ``(accelerator, reason)`` where reason is one line such as ``"DS_ACCELERATOR='cpu'"``.

    Raises:
        AcceleratorError: the requested name is not installed (the message lists the installed ones),
            the requested accelerator is not usable here (with the probe's reason), or no accelerator is
            usable at all.
    """
    env = os.environ if environ is None else environ
    origin = ""
    name = (requested or "").strip()
    if name:
        origin = "accelerator"
    elif env.get(ENV_VAR, "").strip():
        name = env[ENV_VAR].strip()
        origin = ENV_VAR
    if name:
        spec = _requested_spec(registry, name, origin)
        result = probe_accelerator(spec)
        if not result.available:
            usable = [s.name for s in _ordered(registry) if probe_accelerator(s).available]
            raise AcceleratorError(
                f"{origin}={name!r} asks for accelerator {spec.name!r}, which is not usable here: {result.reason}. "
                f"Usable here: {', '.join(usable) or '(none)'}."
            )
        reason = f"{origin}={name!r} ({result.reason})"
        accelerator = _instantiate(spec)
        log.info("accelerator %s selected: %s", spec.name, reason)
        return accelerator, reason

    skipped: list[str] = []
    for spec in _ordered(registry):
        result = probe_accelerator(spec)
        if not result.available:
            skipped.append(f"{spec.name}: {result.reason}")
            continue
        reason = f"auto-detected ({result.reason})"
        if skipped:
            reason += "; skipped " + "; ".join(skipped)
        accelerator = _instantiate(spec)
        log.info("accelerator %s selected: %s", spec.name, reason)
        return accelerator, reason
    raise AcceleratorError(
        "no installed accelerator is usable here: " + ("; ".join(skipped) or "no accelerator plugin is active")
        + ". The built-in cpu accelerator should always be usable; check `dscore plugins list`."
    )


def _ordered(registry: Registry) -> list[AcceleratorSpec]:
    specs = [s for s in registry.specs("accelerator") if isinstance(s, AcceleratorSpec)]
    return sorted(specs, key=lambda s: (-s.priority, s.name.lower()))
