"""Typed lookups over what the active plugins registered.

Selection always comes from the config plus this registry (never from pluggy's ``firstresult``): a
name is looked up case-insensitively among canonical names and aliases; two providers of one name are a
:class:`~dscore.errors.PluginConflictError` listing both; a miss is a
:class:`~dscore.errors.ComponentNotFoundError` naming the config path, what is installed and close
matches (or a :class:`~dscore.errors.PluginLoadError` when a broken plugin might have provided it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from dscore.errors import ComponentNotFoundError, PluginConflictError, PluginLoadError, did_you_mean
from dscore.plugin_manager import DscorePluginManager, PluginRecord
from dscore.specs import SPEC_KINDS, ComponentSpec, ZeroStageSpec

__all__ = ["Registry"]

S = TypeVar("S", bound=ComponentSpec)


class Registry:
    """Index of every spec registered by the active plugins of one plugin manager.

    Args:
        manager: the plugin manager whose active records are indexed (a snapshot is taken).
    """

    def __init__(self, manager: DscorePluginManager) -> None:
        self.manager = manager
        # kind -> lower-case name/alias -> list of (spec, provider record)
        self._index: dict[str, dict[str, list[tuple[ComponentSpec, PluginRecord]]]] = {k: {} for k in SPEC_KINDS}
        self._specs: dict[str, list[tuple[ComponentSpec, PluginRecord]]] = {k: [] for k in SPEC_KINDS}
        for record in manager.active_records():
            for spec in record.specs:
                self._specs[spec.kind].append((spec, record))
                for alias in {n.lower() for n in spec.all_names()}:
                    self._index[spec.kind].setdefault(alias, []).append((spec, record))

    # ---------------------------------------------------------------- listing
    def specs(self, kind: str) -> list[ComponentSpec]:
        """Every spec of ``kind``, in registration order (built-ins first)."""
        return [spec for spec, _ in self._specs[kind]]

    def names(self, kind: str) -> list[str]:
        """Canonical names of ``kind``, sorted case-insensitively."""
        return sorted({spec.name for spec, _ in self._specs[kind]}, key=str.lower)

    def provider(self, spec: ComponentSpec) -> PluginRecord:
        """The plugin record that registered ``spec``."""
        for candidate, record in self._specs[spec.kind]:
            if candidate is spec:
                return record
        raise KeyError(spec)

    def conflicts(self, kind: str | None = None) -> Iterator[tuple[str, str, list[PluginRecord]]]:
        """Yield ``(kind, name, providers)`` for every name given by more than one plugin."""
        for k in [kind] if kind else list(SPEC_KINDS):
            for name, entries in sorted(self._index[k].items()):
                records = _unique_records(entries)
                if len(records) > 1:
                    yield k, name, records

    # ---------------------------------------------------------------- lookup
    def get(self, kind: str, name: str, *, config_path: str = "") -> ComponentSpec:
        """Return the spec of ``kind`` called ``name`` (case-insensitive, aliases included).

        Args:
            kind: a key of :data:`dscore.specs.SPEC_KINDS` (``"optimizer"``).
            name: what the user asked for (``"AdamW"``).
            config_path: where the name came from (``"optimizer.type"``), for the error message.

        Raises:
            PluginConflictError: several plugins provide ``name``; lists each with distribution and version.
            PluginLoadError: not found, and a broken plugin may have provided it.
            ComponentNotFoundError: not found; lists what is installed and close matches.
        """
        entries = self._index[kind].get(str(name).lower(), [])
        records = _unique_records(entries)
        if len(records) > 1:
            raise PluginConflictError(_conflict_message(kind, name, records))
        if entries:
            return entries[0][0]
        raise self._not_found(kind, str(name), config_path)

    def get_typed(self, spec_type: type[S], name: str, *, config_path: str = "") -> S:
        """Like :meth:`get` with the kind taken from ``spec_type`` and the result typed."""
        spec = self.get(spec_type.kind, name, config_path=config_path)
        assert isinstance(spec, spec_type)
        return spec

    def zero_stage(self, stage: int, *, config_path: str = "zero_optimization.stage") -> ZeroStageSpec:
        """Return the ZeRO stage plugin for integer ``stage``.

        Raises:
            PluginConflictError: two plugins register the same stage number.
            ComponentNotFoundError / PluginLoadError: no plugin provides it.
        """
        entries = [(s, r) for s, r in self._specs["zero_stage"] if isinstance(s, ZeroStageSpec) and s.stage == stage]
        records = _unique_records(entries)
        if len(records) > 1:
            raise PluginConflictError(_conflict_message("zero_stage", f"stage {stage}", records))
        if entries:
            spec = entries[0][0]
            assert isinstance(spec, ZeroStageSpec)
            return spec
        raise self._not_found("zero_stage", str(stage), config_path)

    def _not_found(self, kind: str, name: str, config_path: str) -> Exception:
        available = self.names(kind)
        if kind == "zero_stage":
            available = sorted(str(s.stage) for s in self.specs(kind) if isinstance(s, ZeroStageSpec))
        suggestions = did_you_mean(name, available)
        where = f"{config_path} = {name!r}" if config_path else repr(name)
        lines = [f"no {kind.replace('_', ' ')} named {where} is installed."]
        lines.append(f"Installed: {', '.join(available) if available else '(none)'}.")
        if suggestions:
            lines.append(f"Did you mean {' or '.join(repr(s) for s in suggestions)}?")
        broken = self.manager.broken_records()
        if broken:
            lines.append(
                "These plugins are broken and may be the one that provides it: "
                + "; ".join(f"{r.label()}: {r.error}" for r in broken)
            )
            return PluginLoadError(
                " ".join(lines), plugin=broken[0].name, distribution=broken[0].distribution, version=broken[0].version
            )
        lines.append("A plugin providing it may not be installed (see `dscore plugins list`).")
        return ComponentNotFoundError(" ".join(lines), kind=kind, name=name, available=available, suggestions=suggestions)


def _unique_records(entries: list[tuple[ComponentSpec, PluginRecord]]) -> list[PluginRecord]:
    out: list[PluginRecord] = []
    for _, record in entries:
        if all(record is not r for r in out):
            out.append(record)
    return out


def _conflict_message(kind: str, name: str, records: list[PluginRecord]) -> str:
    providers = "; ".join(r.label() for r in records)
    names = ",".join(r.name for r in records if not r.builtin) or records[-1].name
    return (
        f"{kind.replace('_', ' ')} {name!r} is provided by {len(records)} plugins: {providers}. "
        f"Disable all but one, e.g. DSCORE_DISABLE_PLUGINS={names} "
        f'or "plugins": {{"disable": [...]}} in ds_config.'
    )
