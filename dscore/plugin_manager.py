"""Plugin discovery and bookkeeping.

Plugins are found through the ``dscore`` entry-point group (``importlib.metadata``; pluggy's own
setuptools loader is not used because it silently skips a second distribution that reuses a name). Each
entry point names a small *manifest module* holding hookimpls. For every plugin dscore keeps a
:class:`PluginRecord`; a plugin that fails to import, implements a hook that does not exist, or returns
garbage from a registration hook is kept as ``broken`` with a one-line reason instead of crashing
discovery. That includes any ``BaseException`` but ``KeyboardInterrupt`` raised while the manifest is
imported (a module calling ``sys.exit(1)``, a ``GeneratorExit``...): the plugin is broken, everything that
does not select it keeps working.

Built-in plugins are not entry points: they are registered from :data:`BUILTIN_PLUGINS`, a list of
``(name, manifest module)`` in this module (pytest's ``default_plugins``), so editing or adding one needs no
reinstall. Third parties come in through entry points; an entry point of the ``dscore`` distribution itself
(stale metadata of an older install) is ignored.

Blocking, in the order applied:

* ``DSCORE_DISABLE_PLUGIN_AUTOLOAD=1``: only built-in plugins (distribution ``dscore``) and the plugins
  named in ``DSCORE_PLUGINS=a,b`` are loaded (the rest are listed as ``disabled``).
* ``DSCORE_DISABLE_PLUGINS=a,b`` and the config's ``"plugins": {"disable": [...]}`` (passed as
  ``disable=``): a plugin name disables the whole plugin (listed as ``disabled``); a ``kind:name`` item
  (``comm_transport:shm``, ``op_builder:fused_adam``, ``launcher:slurm``) disables that one unit of whichever
  plugin registers it, the rest of the plugin stays active. The ``cpu`` accelerator is essential and cannot
  be disabled (:data:`ESSENTIAL_PLUGINS`, :data:`ESSENTIAL_UNITS`).

Built-in plugins are registered first, third-party plugins after them sorted by name, so results are the
same on every rank.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from dscore import hookspecs
from dscore.errors import PluginError, PluginValidationError, did_you_mean
from dscore.specs import SPEC_KINDS, ComponentSpec

__all__ = [
    "BUILTIN_DISTRIBUTION",
    "BUILTIN_PLUGINS",
    "ESSENTIAL_UNITS",
    "ENTRY_POINT_GROUP",
    "ESSENTIAL_PLUGINS",
    "PluginRecord",
    "DscorePluginManager",
    "create_plugin_manager",
]

ENTRY_POINT_GROUP = "dscore"
BUILTIN_DISTRIBUTION = "dscore"
ESSENTIAL_PLUGINS = frozenset({"cpu"})
#: ``kind:name`` units that cannot be disabled: the fallback every other choice relies on.
ESSENTIAL_UNITS = frozenset({"accelerator:cpu"})

#: the built-in plugins, ``(plugin name, manifest module)``, registered (sorted by name) before any entry point.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("cpu", "dscore_accelerators.cpu.plugin"),
    ("cuda", "dscore_accelerators.cuda.plugin"),
    ("hpu", "dscore_accelerators.hpu.plugin"),
    ("mps", "dscore_accelerators.mps.plugin"),
    ("npu", "dscore_accelerators.npu.plugin"),
    ("xpu", "dscore_accelerators.xpu.plugin"),
    ("checkpoint", "dscore_plugins.checkpoint_ds.plugin"),
    ("comm", "dscore_plugins.comm.plugin"),
    ("engines", "dscore_plugins.engine.plugin"),
    ("launch", "dscore_plugins.launch.plugin"),
    ("lr_schedulers", "dscore_plugins.sched.plugin"),
    ("monitors", "dscore_plugins.monitor.plugin"),
    ("ops", "dscore_plugins.ops.plugin"),
    ("optimizers", "dscore_plugins.optim.plugin"),
    ("parallel", "dscore_plugins.parallel.plugin"),
    ("precision", "dscore_plugins.precision.plugin"),
    ("profiling", "dscore_plugins.profiling.plugin"),
    ("zero", "dscore_plugins.zero.plugin"),
    ("zeropp", "dscore_plugins.zeropp.plugin"),
)

ACTIVE = "active"
DISABLED = "disabled"
BROKEN = "broken"


@dataclass
class PluginRecord:
    """What dscore knows about one plugin.

    Attributes:
        name: the entry-point name (the plugin's identity; what users disable).
        value: the entry-point value (manifest module path), or ``"<object>"`` for a directly registered one.
        distribution: the distribution that declared it (``""`` for a directly registered object).
        version: that distribution's version.
        builtin: True when ``distribution == "dscore"``.
        status: ``"active"``, ``"disabled"`` or ``"broken"``.
        error: one-line reason when broken or disabled, else ``""``.
        provides: kind -> sorted component names it registered (only for active plugins).
        warnings: problems that do not stop the plugin, one line each (its manifest imported torch).
        disabled_units: ``kind:name`` of the units it registered that ``kind:name`` disabling took out
            (they are not in ``specs`` / ``provides``).
    """

    name: str
    value: str
    distribution: str
    version: str
    builtin: bool
    status: str = ACTIVE
    error: str = ""
    provides: dict[str, list[str]] = field(default_factory=dict)
    specs: list[ComponentSpec] = field(default_factory=list, repr=False)
    warnings: list[str] = field(default_factory=list)
    disabled_units: list[str] = field(default_factory=list)
    unit_specs_disabled: list[ComponentSpec] = field(default_factory=list, repr=False)

    def label(self) -> str:
        """``name (distribution version)`` for messages."""
        if self.distribution:
            return f"{self.name} ({self.distribution} {self.version})"
        return self.name

    def as_json(self) -> dict[str, Any]:
        """The JSON shape of ``dscore plugins list --json``."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "status": self.status,
            "error": self.error or None,
            "provides": {kind: sorted(names) for kind, names in self.provides.items()},
            "warnings": list(self.warnings),
            "disabled_units": sorted(self.disabled_units),
        }


def _split_env_list(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def unit_key(kind: str, name: str) -> str:
    """The ``kind:name`` a user writes to disable one unit (lower case)."""
    return f"{kind}:{name}".lower()


def split_disable(items: Iterable[str]) -> tuple[set[str], set[str]]:
    """Split disable items into plugin names and ``kind:name`` units (both lower case).

    Raises:
        PluginError: a ``kind:name`` item names no spec kind (lists the kinds, with a did-you-mean), has an
            empty name, or is essential.
    """
    plugins: set[str] = set()
    units: set[str] = set()
    for raw in items:
        item = raw.strip().lower()
        if not item:
            continue
        if ":" not in item:
            plugins.add(item)
            continue
        kind, _, name = item.partition(":")
        kind, name = kind.strip(), name.strip()
        if kind not in SPEC_KINDS or not name:
            close = did_you_mean(kind, list(SPEC_KINDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(
                f"cannot disable {raw.strip()!r}: a unit is written kind:name with kind one of "
                f"{', '.join(SPEC_KINDS)}{hint}; a plain name disables a whole plugin "
                "(DSCORE_DISABLE_PLUGINS / plugins.disable)"
            )
        units.add(unit_key(kind, name))
    essential = units & ESSENTIAL_UNITS
    if essential:
        raise PluginError(
            f"unit(s) {sorted(essential)} cannot be disabled: the cpu accelerator is essential (it is the fallback "
            "every other accelerator relies on). Remove it from DSCORE_DISABLE_PLUGINS / plugins.disable."
        )
    return plugins, units


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        # say so plainly: "SystemExit: 1" reads like a bug in dscore
        return f"SystemExit: the plugin called sys.exit({exc.code!r})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _builtin_version() -> str:
    try:
        return importlib.metadata.version(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path, not installed
        return "0+unknown"


class DscorePluginManager:
    """A pluggy plugin manager plus dscore's records of every discovered plugin.

    Create one with :func:`create_plugin_manager`; there is no global instance. Use
    :class:`dscore.registry.Registry` for typed lookups of what the plugins registered.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        # entry points of disabled plugins, loaded only to explain an error (see disabled_providers)
        self._disabled_entry_points: dict[str, importlib.metadata.EntryPoint] = {}
        self._disabled_specs: dict[str, list[ComponentSpec]] = {}
        # kind:name units disabled by DSCORE_DISABLE_PLUGINS / plugins.disable
        self.disabled_units: set[str] = set()

    # ---------------------------------------------------------------- loading
    def load_entry_points(
        self,
        entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
        *,
        disable: Sequence[str] = (),
        environ: dict[str, str] | os._Environ[str] | None = None,
        builtins: bool = True,
    ) -> None:
        """Register the built-in plugins (:data:`BUILTIN_PLUGINS`), then discover every third-party plugin of
        the ``dscore`` entry-point group.

        Args:
            entry_points: entry points to use instead of the installed metadata (tests).
            disable: plugin names or ``kind:name`` units to disable in addition to ``DSCORE_DISABLE_PLUGINS``.
            environ: environment to read the blocking variables from (default ``os.environ``).
            builtins: False to register only the entry points (tests of discovery itself).

        Raises:
            PluginError: when asked to disable an essential plugin or unit (``cpu``), or a malformed
                ``kind:name``.
        """
        env = os.environ if environ is None else environ
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        disabled, self.disabled_units = split_disable([*_split_env_list(env.get("DSCORE_DISABLE_PLUGINS")), *disable])
        essential = disabled & ESSENTIAL_PLUGINS
        if essential:
            raise PluginError(
                f"plugin(s) {sorted(essential)} cannot be disabled: the cpu accelerator is essential "
                "(it is the fallback every other accelerator relies on). Remove it from "
                "DSCORE_DISABLE_PLUGINS / plugins.disable."
            )
        autoload_off = env.get("DSCORE_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in {"1", "true", "yes"}
        allowed = {n.lower() for n in _split_env_list(env.get("DSCORE_PLUGINS"))}

        candidates: list[tuple[importlib.metadata.EntryPoint, str, str]] = []
        if builtins:
            version = _builtin_version()
            for name, module in BUILTIN_PLUGINS:
                ep = importlib.metadata.EntryPoint(name=name, value=module, group=ENTRY_POINT_GROUP)
                candidates.append((ep, BUILTIN_DISTRIBUTION, version))
        seen: set[tuple[str, str, str]] = set()
        for ep in entry_points:
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else ""
            dist_version = dist.version if dist is not None else ""
            if builtins and dist_name == BUILTIN_DISTRIBUTION:
                continue  # built-ins come from BUILTIN_PLUGINS; this is stale metadata of an older install
            key = (ep.name, ep.value, dist_name)
            if key in seen:  # the same distribution found twice on sys.path
                continue
            seen.add(key)
            candidates.append((ep, dist_name or "", dist_version or ""))

        def order(item: tuple[importlib.metadata.EntryPoint, str, str]) -> tuple[int, str, str]:
            ep, dist_name, _ = item
            return (0 if dist_name == BUILTIN_DISTRIBUTION else 1, ep.name.lower(), dist_name)

        for ep, dist_name, dist_version in sorted(candidates, key=order):
            record = PluginRecord(
                name=ep.name,
                value=ep.value,
                distribution=dist_name,
                version=dist_version,
                builtin=dist_name == BUILTIN_DISTRIBUTION,
            )
            if ep.name in self.records:
                first = self.records[ep.name]
                record.status = BROKEN
                record.error = (
                    f"plugin name {ep.name!r} is already used by {first.label()}; "
                    f"uninstall one of the two distributions or rename its entry point"
                )
                self.records[f"{ep.name}@{dist_name}"] = record
                continue
            self.records[ep.name] = record
            if ep.name.lower() in disabled:
                record.status = DISABLED
                record.error = "disabled by DSCORE_DISABLE_PLUGINS or plugins.disable"
                self._disabled_entry_points[ep.name] = ep
                continue
            if autoload_off and not record.builtin and ep.name.lower() not in allowed:
                record.status = DISABLED
                record.error = "DSCORE_DISABLE_PLUGIN_AUTOLOAD is set and the plugin is not in DSCORE_PLUGINS"
                self._disabled_entry_points[ep.name] = ep
                continue
            torch_before = "torch" in sys.modules
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - sys.exit() at import too: broken, never fatal
                record.status = BROKEN
                record.error = f"import of {ep.value!r} failed: {_one_line(exc)}"
                continue
            if not torch_before and "torch" in sys.modules:
                # cheap check of the "manifests stay light" rule: only the first offender is seen
                record.warnings.append(
                    f"importing its manifest {ep.value!r} imported torch; a manifest must import only dscore.specs "
                    "and dscore.hookspecs (put torch imports in the modules its import strings name), or every "
                    "dscore command pays for torch"
                )
            self._register(record, plugin)

    def register_object(self, plugin: object, name: str, *, distribution: str = "", version: str = "") -> PluginRecord:
        """Register a plugin object (module or instance) directly, without an entry point.

        Used by tests and by programs embedding dscore. The record is ``builtin`` only when
        ``distribution == "dscore"``.

        Raises:
            PluginError: ``name`` is already registered.
        """
        if name in self.records:
            raise PluginError(f"a plugin named {name!r} is already registered ({self.records[name].label()})")
        record = PluginRecord(
            name=name,
            value="<object>",
            distribution=distribution,
            version=version,
            builtin=distribution == BUILTIN_DISTRIBUTION,
        )
        self.records[name] = record
        self._register(record, plugin)
        return record

    def _register(self, record: PluginRecord, plugin: object) -> None:
        try:
            self.pm.register(plugin, name=record.name)
        except Exception as exc:
            record.status = BROKEN
            record.error = f"registration failed: {_one_line(exc)}"
            return
        problem = self._unknown_hooks(record.name, plugin)
        if problem:
            self.pm.unregister(name=record.name)
            record.status = BROKEN
            record.error = problem
            return
        try:
            self._collect_specs(record, plugin)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a registration hook calling sys.exit() is broken too
            self.pm.unregister(name=record.name)
            record.status = BROKEN
            record.error = _one_line(exc)
            record.specs.clear()
            record.provides.clear()

    def _unknown_hooks(self, name: str, plugin: object) -> str:
        """Return a message for hooks the plugin implements that dscore does not define, else ``""``."""
        known = [h for h in dir(hookspecs) if h.startswith("dscore_")]
        bad: list[str] = []
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                bad.append(caller.name)
        if not bad:
            try:
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                return _one_line(exc)
            return ""
        parts = []
        for hook in sorted(bad):
            close = did_you_mean(hook, known, n=1)
            parts.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"plugin {name!r} implements unknown hook(s) {', '.join(parts)}"

    def _collect_specs(self, record: PluginRecord, plugin: object) -> None:
        for hook_name, kind in hookspecs.REGISTRATION_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                result = impl.function()
                if result is None:
                    continue
                spec_cls = SPEC_KINDS[kind]
                for spec in result:
                    if not isinstance(spec, spec_cls):
                        raise PluginValidationError(
                            f"{hook_name} of plugin {record.name!r} returned {spec!r}; "
                            f"expected {spec_cls.__name__} instances"
                        )
                    if self.disabled_units and any(unit_key(kind, n) in self.disabled_units for n in spec.all_names()):
                        record.disabled_units.append(unit_key(kind, spec.name))
                        record.unit_specs_disabled.append(spec)
                        continue
                    record.specs.append(spec)
                    record.provides.setdefault(kind, []).append(spec.name)
        for names in record.provides.values():
            names.sort(key=str.lower)

    # ---------------------------------------------------------------- queries
    def active_records(self) -> list[PluginRecord]:
        """Records of active plugins, in registration order."""
        return [r for r in self.records.values() if r.status == ACTIVE]

    def broken_records(self) -> list[PluginRecord]:
        """Records of broken plugins."""
        return [r for r in self.records.values() if r.status == BROKEN]

    def disabled_records(self) -> list[PluginRecord]:
        """Records of installed plugins that were disabled (by name or by autoload being off)."""
        return [r for r in self.records.values() if r.status == DISABLED]

    def disabled_providers(self, kind: str, name: str) -> list[PluginRecord]:
        """Disabled plugins whose manifest registers a ``kind`` component called ``name`` (aliases and
        case included), so an error can say "plugin X provides it but is disabled" instead of "not
        installed".

        Each disabled manifest is imported at most once, into a scratch manager (its hooks never join
        this one); a manifest that cannot be imported is skipped. Only error paths call this.
        """
        wanted = str(name).lower()
        return [
            record
            for record in self.disabled_records()
            if any(s.kind == kind and wanted in {n.lower() for n in s.all_names()} for s in self.disabled_specs(record))
        ]

    def disabled_unit_providers(self, kind: str, name: str) -> list[PluginRecord]:
        """Active plugins whose ``kind`` unit called ``name`` (aliases and case included) was disabled as
        ``kind:name``, so an error can say how to re-enable it."""
        wanted = str(name).lower()
        return [
            record
            for record in self.active_records()
            if any(s.kind == kind and wanted in {n.lower() for n in s.all_names()} for s in record.unit_specs_disabled)
        ]

    def disabled_specs(self, record: PluginRecord) -> list[ComponentSpec]:
        """What the disabled plugin ``record`` would register (``[]`` when its manifest cannot be loaded or
        it was registered without an entry point). Imported once, into a scratch manager."""
        specs = self._disabled_specs.get(record.name)
        if specs is None:
            specs = []
            ep = self._disabled_entry_points.get(record.name)
            if ep is not None:
                scratch = DscorePluginManager()
                try:
                    probe: PluginRecord | None = scratch.register_object(ep.load(), record.name)
                except Exception:  # noqa: BLE001 - only used to improve a message
                    probe = None
                if probe is not None and probe.status == ACTIVE:
                    specs = list(probe.specs)
            self._disabled_specs[record.name] = specs
        return specs

    def check_healthy(self) -> None:
        """Raise when any plugin implements an unknown hook, so a misspelled hook fails at start.

        Raises:
            PluginValidationError: naming the plugin, distribution and version and how to disable it.
        """
        for record in self.broken_records():
            if "unknown hook" in record.error:
                raise PluginValidationError(
                    f"{record.label()}: {record.error}. Fix the hook name, or disable the plugin with "
                    f"DSCORE_DISABLE_PLUGINS={record.name}"
                )

    def has_implementations(self, hook_name: str) -> bool:
        """True when at least one active plugin implements ``hook_name`` (lifecycle hooks are skipped otherwise)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def call(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """Call a setup or lifecycle hook with keyword arguments, skipping it when nobody implements it."""
        caller = getattr(self.pm.hook, hook_name)
        if not caller.get_hookimpls():
            return []
        return caller(**kwargs)

    def fingerprint(self) -> str:
        """A short hash of the active plugin set (names, distributions, versions), equal across ranks
        exactly when they run the same plugins."""
        items = sorted((r.name, r.distribution, r.version, r.status, sorted(r.disabled_units)) for r in self.records.values())
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]

    def describe(self) -> list[tuple[str, str, str, str]]:
        """``(name, distribution, version, status)`` per plugin, for mismatch messages."""
        return sorted((r.name, r.distribution, r.version, r.status) for r in self.records.values())


def create_plugin_manager(
    *,
    disable: Sequence[str] = (),
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
    extra_plugins: Iterable[tuple[str, object]] = (),
    environ: dict[str, str] | None = None,
    load_entry_points: bool = True,
    builtins: bool = True,
) -> DscorePluginManager:
    """Build a fresh plugin manager with all installed plugins discovered.

    Args:
        disable: extra plugin names to disable (the config's ``plugins.disable``).
        entry_points: use these instead of the installed ``dscore`` entry points.
        extra_plugins: ``(name, plugin_object)`` pairs registered after discovery (tests, embedding).
        environ: environment for the blocking variables (default ``os.environ``).
        load_entry_points: False to skip discovery entirely (only ``extra_plugins``).
        builtins: False to discover only entry points, without :data:`BUILTIN_PLUGINS`.

    Returns:
        A new :class:`DscorePluginManager`. Nothing is cached between calls.
    """
    manager = DscorePluginManager()
    if load_entry_points:
        manager.load_entry_points(entry_points, disable=disable, environ=environ, builtins=builtins)
    for name, plugin in extra_plugins:
        if isinstance(plugin, str):
            plugin = importlib.import_module(plugin)
        manager.register_object(plugin, name)
    return manager

