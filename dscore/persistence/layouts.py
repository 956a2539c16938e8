"""Choosing a checkpoint layout: by name at save, by detection at load, through the registry.

Layouts are the ``checkpoint_layout`` plugin units (:class:`dscore.specs.CheckpointLayoutSpec`, contract
:class:`dscore.protocols.CheckpointLayout`): ``dscore`` (the native, pickle-free layout,
:mod:`dscore.persistence.native`) and ``deepspeed`` (DeepSpeed 0.19.8's files) are built in; a third party
adds one through an entry point.

* Save: the layout ``engine.checkpoint_layout`` (or ``save_checkpoint(layout=...)``) names; an unknown name
  is the registry's error with close matches, a disabled unit the registry's error naming
  ``checkpoint_layout:<name>`` and how to re-enable it.
* Load: the layout named in the tag's ``_COMPLETE`` manifest (a save through dscore records it); else the
  first layout whose ``detect`` says yes, asked in descending ``detect_priority`` (ties by name); else, when
  a *disabled* layout would have read it, a :class:`~dscore.errors.CheckpointError` naming that unit; else
  the native layout (whose tag rules give the "not found" errors).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dscore.errors import CheckpointError
from dscore.persistence import savedir as S
from dscore.specs import CheckpointLayoutSpec, resolve

__all__ = ["KIND", "NATIVE", "CONFIG_PATH", "layout_for_load", "layout_for_save", "layout_names", "load_layout"]

logger = logging.getLogger("dscore.checkpoint")

KIND = "checkpoint_layout"
#: the native layout's unit name (the default of ``engine.checkpoint_layout``).
NATIVE = "dscore"
#: where a save's layout name comes from, for messages.
CONFIG_PATH = "engine.checkpoint_layout"


def load_layout(registry: Any, spec: CheckpointLayoutSpec) -> Any:
    """The layout object ``spec.layout`` names (import errors name the plugin: :meth:`Registry.load`)."""
    return registry.load(spec, "layout")


def layout_for_save(registry: Any, name: object) -> tuple[str, Any]:
    """``(canonical name, layout object)`` for saving in layout ``name``.

    Raises:
        ComponentNotFoundError / PluginLoadError / PluginConflictError: unknown (close matches listed),
            disabled (``checkpoint_layout:<name>`` named with how to re-enable it), broken or provided twice.
    """
    spec = registry.get(KIND, str(name), config_path=CONFIG_PATH)
    assert isinstance(spec, CheckpointLayoutSpec)
    return spec.name, load_layout(registry, spec)


def layout_names(registry: Any) -> list[str]:
    """The registered layouts in detection order (descending ``detect_priority``, then name)."""
    specs = [s for s in registry.specs(KIND) if isinstance(s, CheckpointLayoutSpec)]
    return [s.name for s in sorted(specs, key=lambda s: (-s.detect_priority, s.name.lower()))]


def _manifest_layout(save_dir: str, tag: str | None) -> str | None:
    """The ``"layout"`` a dscore-published tag's manifest records (``"dscore"`` when it names none)."""
    name = tag if tag is not None else S.read_latest(save_dir)
    if not name or "/" in name or name in (".", ".."):
        return None
    manifest = S.read_manifest(os.path.join(save_dir, name))
    if manifest is None:
        return None
    return str(manifest.get("layout") or NATIVE)


def _safe_detect(layout: Any, save_dir: str, tag: str | None) -> bool:
    try:
        return bool(layout.detect(save_dir, tag))
    except Exception:  # noqa: BLE001 - detect must not raise; a broken one just does not claim the directory
        logger.debug("checkpoint layout %r: detect(%r) raised", getattr(layout, "name", layout), save_dir, exc_info=True)
        return False


def _disabled_specs(registry: Any) -> list[tuple[CheckpointLayoutSpec, str]]:
    """``(spec, how it is disabled)`` of every layout a disabled unit or disabled plugin would register."""
    manager = getattr(registry, "manager", None)
    if manager is None:
        return []
    out: list[tuple[CheckpointLayoutSpec, str]] = []
    for record in manager.active_records():
        for spec in getattr(record, "unit_specs_disabled", ()):
            if isinstance(spec, CheckpointLayoutSpec):
                key = f"{KIND}:{spec.name}"
                out.append((spec, f"the unit {key} of plugin {record.label()} is disabled (remove {key} from "
                                  "DSCORE_DISABLE_PLUGINS and from plugins.disable in ds_config to read it)"))
    for record in manager.disabled_records():
        for spec in manager.disabled_specs(record):
            if isinstance(spec, CheckpointLayoutSpec):
                out.append((spec, f"the plugin {record.label()} that provides the unit {KIND}:{spec.name} is disabled "
                                  f"(remove {record.name} from DSCORE_DISABLE_PLUGINS and from plugins.disable to read it)"))
    return out


def _refuse_disabled(registry: Any, save_dir: str, tag: str | None, manifest_layout: str | None) -> None:
    for spec, why in _disabled_specs(registry):
        if manifest_layout is not None:
            hit = spec.name.lower() == manifest_layout.lower()
        else:
            try:
                hit = _safe_detect(resolve(spec.layout), save_dir, tag)
            except Exception:  # noqa: BLE001 - the disabled plugin's module may not even import
                hit = False
        if hit:
            raise CheckpointError(
                f"{save_dir} holds a checkpoint in the {spec.name!r} layout, which is read by {KIND}:{spec.name}; "
                f"{why}"
            )


def layout_for_load(registry: Any, save_dir: str, tag: str | None) -> tuple[str, Any]:
    """``(name, layout object)`` that reads ``save_dir`` (tag ``tag`` or ``latest``); see the module docs.

    Raises:
        CheckpointError: the checkpoint is in a layout whose unit (or plugin) is disabled (named, with how to
            re-enable it); ComponentNotFoundError: its manifest names a layout no installed plugin provides.
    """
    recorded = _manifest_layout(save_dir, tag) if os.path.isdir(save_dir) else None
    names = {n.lower() for n in registry.names(KIND)}
    if recorded is not None:
        if recorded.lower() not in names:
            _refuse_disabled(registry, save_dir, tag, recorded)
        return layout_for_save_or_read(registry, recorded, save_dir)
    for name in layout_names(registry):
        spec = registry.get(KIND, name)
        layout = load_layout(registry, spec)
        if _safe_detect(layout, save_dir, tag):
            return spec.name, layout
    _refuse_disabled(registry, save_dir, tag, None)
    return layout_for_save_or_read(registry, NATIVE, save_dir)


def layout_for_save_or_read(registry: Any, name: str, save_dir: str) -> tuple[str, Any]:
    """``(name, layout)`` of the registered layout ``name`` for reading ``save_dir`` (the registry's errors)."""
    spec = registry.get(KIND, name, config_path=f"the layout of {save_dir}")
    assert isinstance(spec, CheckpointLayoutSpec)
    return spec.name, load_layout(registry, spec)
