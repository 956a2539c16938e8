"""Typed lookups over what the active plugins registered.

Selection always comes from the config plus this registry (never from pluggy's ``firstresult``): a
name is looked up case-insensitively among canonical names and aliases; two providers of one name are a
:class:`~dscore.errors.PluginConflictError` listing both; a miss is a
:class:`~dscore.errors.ComponentNotFoundError` naming the config path, what is installed and close
matches (or a :class:`~dscore.errors.PluginLoadError` when a broken plugin might have provided it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from dscore.errors import ComponentNotFoundError, ConfigError, PluginConflictError, PluginLoadError, did_you_mean
from dscore.plugin_manager import DscorePluginManager, PluginRecord
from dscore.specs import SPEC_KINDS, ComponentSpec, EngineSpec, ZeroStageSpec, resolve

__all__ = ["Registry", "disabled_message"]

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

    def load(self, spec: ComponentSpec, field: str = "factory") -> Any:
        """Import the object named by the import string ``spec.<field>`` (``"pkg.mod:attr"``).

        Use this rather than :func:`dscore.specs.resolve` wherever a registered spec's import string is
        followed, so a typo or a broken plugin module names the plugin instead of raising a bare
        ``ImportError``/``AttributeError``.

        Args:
            spec: a spec this registry holds (its provider is looked up for the message).
            field: the spec attribute holding the import string (``"factory"``, ``"offload_factory"``).

        Raises:
            PluginLoadError: the string is malformed, its module cannot be imported, or the attribute does
                not exist; the message names the plugin (distribution and version), the spec's kind and
                name, the field and the import string, and chains the original error.
        """
        target = getattr(spec, field)
        try:
            return resolve(target)
        except Exception as exc:  # noqa: BLE001 - any failure importing a plugin's module is the plugin's
            try:
                record: PluginRecord | None = self.provider(spec)
            except KeyError:
                record = None
            who = f"plugin {record.label()}" if record is not None else "an unregistered spec"
            raise PluginLoadError(
                f"{who}: {spec.kind.replace('_', ' ')} {spec.name!r} has {field}={target!r}, which cannot be "
                f"imported: {type(exc).__name__}: {exc}. Fix the import string in the plugin's spec "
                "(it must look like 'package.module:attribute'), or disable the plugin with "
                f"DSCORE_DISABLE_PLUGINS={record.name if record is not None else '<name>'}",
                plugin=record.name if record is not None else "",
                distribution=record.distribution if record is not None else "",
                version=record.version if record is not None else "",
            ) from exc

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

    def zero_stage(
        self, stage: int, *, implementation: str | None = None, config_path: str = "zero_optimization.stage"
    ) -> ZeroStageSpec:
        """Return the ZeRO stage plugin for integer ``stage``: the spec named ``implementation`` when
        given (``zero_optimization.implementation``), else the default spec registered for ``stage``.

        Raises:
            ConfigError: ``implementation`` implements another stage than ``stage`` (both named).
            PluginConflictError: two plugins register a default spec for the same stage number.
            ComponentNotFoundError / PluginLoadError: no plugin provides it (installed names and close
                matches listed).
        """
        if implementation is not None:
            spec = self.get("zero_stage", implementation, config_path="zero_optimization.implementation")
            assert isinstance(spec, ZeroStageSpec)
            if spec.stage != stage:
                raise ConfigError(
                    f"zero_optimization.implementation = {implementation!r} implements ZeRO stage {spec.stage}, "
                    f"but zero_optimization.stage is {stage}; set the stage to {spec.stage} or pick an "
                    f"implementation of stage {stage}: {', '.join(self._stage_names(stage)) or '(none)'}",
                    path="zero_optimization.implementation",
                )
            return spec
        entries: list[tuple[ComponentSpec, PluginRecord]] = [
            (s, r)
            for s, r in self._specs["zero_stage"]
            if isinstance(s, ZeroStageSpec) and s.stage == stage and s.default
        ]
        records = _unique_records(entries)
        if len(records) > 1:
            raise PluginConflictError(_conflict_message("zero_stage", f"stage {stage}", records))
        if entries:
            spec = entries[0][0]
            assert isinstance(spec, ZeroStageSpec)
            return spec
        raise self._not_found("zero_stage", str(stage), config_path)

    def select_engine(self, model: object, config: object) -> EngineSpec:
        """The engine spec whose predicate accepts ``model`` and ``config`` (highest ``priority`` wins).

        Every engine's ``predicate`` is resolved and called as ``predicate(model, config)``.

        Raises:
            PluginConflictError: two engines accept the model at the same top priority (both named with
                their plugins, and how to disable one).
            PluginLoadError: a predicate cannot be imported, raises, or returns a non-bool (the plugin named).
            ComponentNotFoundError: no engine accepts the model (lists the engines asked and the model type).
        """
        accepted: list[tuple[EngineSpec, PluginRecord]] = []
        for spec, record in self._specs["engine"]:
            assert isinstance(spec, EngineSpec)
            try:
                answer = resolve(spec.predicate)(model, config)
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin {record.label()}: engine {spec.name!r} predicate {spec.predicate!r} failed: "
                    f"{type(exc).__name__}: {exc}",
                    plugin=record.name,
                    distribution=record.distribution,
                    version=record.version,
                ) from exc
            if not isinstance(answer, bool):
                raise PluginLoadError(
                    f"plugin {record.label()}: engine {spec.name!r} predicate {spec.predicate!r} returned "
                    f"{type(answer).__name__}, expected a bool",
                    plugin=record.name,
                    distribution=record.distribution,
                    version=record.version,
                )
            if answer:
                accepted.append((spec, record))
        if not accepted:
            asked = self.names("engine")
            message = (
                f"no engine handles a model of type {type(model).__name__}: "
                f"engines asked: {', '.join(asked) if asked else '(none installed)'}. "
            )
            broken = self.manager.broken_records()
            if broken:
                message += "These plugins are broken and may provide one: " + "; ".join(
                    f"{r.label()}: {r.error}" for r in broken
                )
                raise PluginLoadError(
                    message, plugin=broken[0].name, distribution=broken[0].distribution, version=broken[0].version
                )
            message += "Install or enable a plugin registering an engine (see `dscore plugins list --kind engine`)."
            raise ComponentNotFoundError(message, kind="engine", name=type(model).__name__, available=asked, suggestions=[])
        top = max(spec.priority for spec, _ in accepted)
        best = [(s, r) for s, r in accepted if s.priority == top]
        if len(best) > 1:
            names = ", ".join(f"{s.name} ({r.label()})" for s, r in best)
            raise PluginConflictError(
                f"engines {names} all accept a model of type {type(model).__name__} at priority {top}; "
                "give one a higher EngineSpec.priority or disable the others with DSCORE_DISABLE_PLUGINS=<name> "
                'or "plugins": {"disable": [...]} in ds_config'
            )
        return best[0][0]

    def _stage_names(self, stage: int) -> list[str]:
        return sorted(s.name for s in self.specs("zero_stage") if isinstance(s, ZeroStageSpec) and s.stage == stage)

    def _not_found(self, kind: str, name: str, config_path: str) -> Exception:
        available = self.names(kind)
        if kind == "zero_stage" and config_path != "zero_optimization.implementation":
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
        units = self.manager.disabled_unit_providers(kind, name)
        if units:
            key = f"{kind}:{name.lower()}"
            labels = ", ".join(r.label() for r in units)
            return ComponentNotFoundError(
                f"{_KIND_WORDS.get(kind, kind.replace('_', ' '))} {where} is provided by {labels}, but that unit is "
                f"disabled ({key!r} in DSCORE_DISABLE_PLUGINS or the config's plugins.disable). To use it, remove "
                f"{key} from DSCORE_DISABLE_PLUGINS and from plugins.disable in ds_config.",
                kind=kind, name=name, available=available, suggestions=suggestions,
            )
        disabled = self.manager.disabled_providers(kind, name)
        if disabled:
            return ComponentNotFoundError(
                disabled_message(kind, where, disabled), kind=kind, name=name, available=available, suggestions=suggestions
            )
        lines.append("A plugin providing it may not be installed (see `dscore plugins list`).")
        return ComponentNotFoundError(" ".join(lines), kind=kind, name=name, available=available, suggestions=suggestions)


_KIND_WORDS = {"config_section": "ds_config section"}


def disabled_message(kind: str, what: str, records: list[PluginRecord]) -> str:
    """"<kind> <what> is provided by the installed plugin X, which is disabled ..." with how to enable it.

    Args:
        kind: a spec kind (``"optimizer"``, ``"config_section"``).
        what: the name as the message should show it (``"optimizer.type = 'OnlyA'"``).
        records: the disabled providers (from :meth:`DscorePluginManager.disabled_providers`).
    """
    labels = ", ".join(r.label() for r in records)
    names = ",".join(r.name for r in records)
    plural = "s" if len(records) > 1 else ""
    if all("AUTOLOAD" in r.error for r in records):
        why = "DSCORE_DISABLE_PLUGIN_AUTOLOAD is set and it is not in DSCORE_PLUGINS"
        how = f"add it to DSCORE_PLUGINS (DSCORE_PLUGINS={names}) or unset DSCORE_DISABLE_PLUGIN_AUTOLOAD"
    else:
        why = "by DSCORE_DISABLE_PLUGINS or the config's plugins.disable"
        how = f"remove {names} from DSCORE_DISABLE_PLUGINS and from plugins.disable in ds_config"
    return (
        f"{_KIND_WORDS.get(kind, kind.replace('_', ' '))} {what} is provided by the installed plugin{plural} {labels}, which "
        f"{'are' if plural else 'is'} disabled ({why}). To use it, {how}."
    )


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
