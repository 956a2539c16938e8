"""The config-key audit: what dscore does with every key of DeepSpeed's config and of its own models.

``python -m dscore.config.audit`` prints the audit; ``--write`` regenerates ``docs/config-keys.md``;
``--check`` exits 1 when a model field is *unread* (see below) or the file is out of date (a key added,
removed or with another status; the *where* column may drift until the next ``--write``). After adding
or changing a config field (a new block, a new key), read it where it takes effect or mark it in its model
(:func:`dscore.config.base.no_effect` / :func:`dscore.config.base.not_implemented`), then run ``--write``;
``tests/unit/test_config_audit.py`` fails and says so when you forget.

Each key gets one status:

* **implemented**: the field is read outside the module defining its model (an attribute access
  ``.name`` or a string constant ``"name"`` that is not a docstring, found by reading the source of
  ``dscore/`` and of every installed plugin package with :mod:`ast`); the first places are listed.
  The first three files are listed. This is a static approximation: a field sharing its name with another attribute (``enabled``) counts as
  read when any of them is.
* **warned**: marked :func:`dscore.config.base.no_effect` in its model; setting it logs a warning.
* **refused**: marked :func:`dscore.config.base.not_implemented`; a non-default value is a ``ConfigError``.
  Top-level DeepSpeed features dscore gates as a whole (:data:`dscore.config.keys.GATED_KEYS`) are refused
  when they would change training and warned when off; :data:`dscore.config.keys.IGNORED_KEYS` are warned.
* **unknown**: a DeepSpeed key no dscore model has: refused as an unknown key (a warning with
  ``"strict": false``).
* **unread**: a model field that is read nowhere and not marked: a key accepted and ignored. The check
  fails on it.

DeepSpeed's keys come from ``dscore/config/deepspeed_keys.json``, written by
``tools/dump_deepspeed_keys.py`` from an installed DeepSpeed (0.19.8); top-level keys also from
:data:`dscore.config.keys.DEEPSPEED_KEYS`.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dscore.config.base import field_status

__all__ = ["AuditRow", "audit", "render_markdown", "statuses", "stale_keys", "unread_fields", "main", "DOC_PATH", "REGENERATE"]

#: the command that regenerates the document
REGENERATE = "python -m dscore.config.audit --write"
_REPO = Path(__file__).resolve().parents[2]
#: where ``--write`` puts the audit (a checkout's ``docs/``)
DOC_PATH = _REPO / "docs" / "config-keys.md"
_KEYS_JSON = Path(__file__).with_name("deepspeed_keys.json")
_SKIP_FILES = {Path(__file__).resolve(), Path(__file__).with_name("keys.py").resolve()}


@dataclass(frozen=True)
class AuditRow:
    """One key: ``path`` (DeepSpeed's spelling), ``status`` (implemented / warned / refused / unknown /
    unread / block), ``detail`` (where it is read, or the reason), ``deepspeed`` (a DeepSpeed key) and
    ``dscore`` (a field of a dscore model)."""

    path: str
    status: str
    detail: str
    deepspeed: bool
    dscore: bool


def _source_roots() -> list[Path]:
    """dscore's package and the top-level package of every built-in plugin (``BUILTIN_PLUGINS``) and of every
    installed plugin (entry-point group ``dscore``)."""
    import importlib
    from importlib.metadata import entry_points

    import dscore
    from dscore.plugin_manager import BUILTIN_PLUGINS

    roots = [Path(dscore.__file__).resolve().parent]
    modules = [module for _, module in BUILTIN_PLUGINS] + [ep.module for ep in entry_points(group="dscore")]
    for top in sorted({module.split(".")[0] for module in modules}):
        try:
            mod = importlib.import_module(top)
        except ImportError:
            continue
        path = Path(getattr(mod, "__file__", "") or "").resolve().parent
        if path not in roots and path.is_dir():
            roots.append(path)
    return roots


_VALIDATORS = {"field_validator", "model_validator", "validator", "root_validator"}


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else ""


@cache
def _reads() -> dict[str, list[tuple[Path, int]]]:
    """name -> places (file, line) that read an attribute or pass a string of that name."""
    found: dict[str, list[tuple[Path, int]]] = {}
    for root in _source_roots():
        for path in sorted(root.rglob("*.py")):
            if path.resolve() in _SKIP_FILES:
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            docstrings = {
                id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
            }
            # reads inside pydantic validators check a value; they do not make it take effect
            spans = [
                (f.lineno, f.end_lineno or f.lineno)
                for f in ast.walk(tree)
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                and any(_decorator_name(d) in _VALIDATORS for d in f.decorator_list)
            ]
            validating = {ln for a, b in spans for ln in range(a, b + 1)}
            for node in ast.walk(tree):
                if getattr(node, "lineno", None) in validating:
                    continue
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    found.setdefault(node.attr, []).append((path, node.lineno))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    if node.value.isidentifier():
                        found.setdefault(node.value, []).append((path, node.lineno))
    return found


def _in_class(model: type, line: int) -> bool:
    """Whether ``line`` of the model's file is inside the model's class body's field declarations
    (reads there are the declarations and defaults, not uses); methods of the class count as uses."""
    try:
        lines, start = inspect.getsourcelines(model)
    except (OSError, TypeError):
        return True
    if not start <= line < start + len(lines):
        return False
    text = lines[line - start].strip()
    return not text.startswith(("return ", "if ", "elif ", "for ", "while ")) and "self." not in text


def _model_file(model: type) -> Path | None:
    try:
        return Path(inspect.getsourcefile(model) or "").resolve()
    except TypeError:
        return None


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *typing.get_args(annotation)]
    for arg in candidates:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        if isinstance(arg, types.UnionType):
            candidates.extend(typing.get_args(arg))
    return None


def _relative(path: Path) -> str:
    for base in (_REPO, *(r.parent for r in _source_roots())):
        try:
            return str(path.relative_to(base))
        except ValueError:
            continue
    return str(path)


def _model_rows(model: type[BaseModel], prefix: str, out: dict[str, AuditRow]) -> None:
    home = _model_file(model)
    reads = _reads()
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}.{key}" if prefix else key
        sub = _submodel(field.annotation)
        status = field_status(field)
        if status is not None:
            out[path] = AuditRow(path, status[0], status[1], False, True)
        else:
            # reads in other files, or in the model's own file outside validators (an accessor method)
            places = [(f, ln) for n in {name, key} for f, ln in reads.get(n, []) if f != home or not _in_class(model, ln)]
            if places:
                # files only (no line numbers, no counts): the document changes when a key moves, not on every edit
                files = sorted({_relative(f) for f, _ in places})
                shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
                out[path] = AuditRow(path, "implemented", shown, False, True)
            elif sub is not None:
                out[path] = AuditRow(path, "block", "its fields below", False, True)
            else:
                out[path] = AuditRow(path, "unread", f"read nowhere outside {_relative(home) if home else '?'}", False, True)
        if sub is not None and sub is not model:
            _model_rows(sub, path, out)


def _deepspeed_keys() -> tuple[str, dict[str, dict[str, Any]]]:
    data = json.loads(_KEYS_JSON.read_text(encoding="utf-8"))
    return str(data["deepspeed"]), dict(data["keys"])


def audit(registry: Any = None) -> tuple[str, list[AuditRow]]:
    """Audit the assembled config model of ``registry`` (default: the installed plugins).

    Returns:
        ``(DeepSpeed version of the key list, rows sorted by path)``.
    """
    from dscore.config.keys import DEEPSPEED_KEYS, GATED_KEYS, IGNORED_KEYS
    from dscore.config.model import build_config_model
    if registry is None:
        from dscore.plugin_manager import create_plugin_manager
        from dscore.registry import Registry

        registry = Registry(create_plugin_manager())
    model_cls, sections = build_config_model(registry)
    aliases = {a: name for name, info in sections.items() for a in info.spec.all_names() if a != name}
    rows: dict[str, AuditRow] = {}
    _model_rows(model_cls, "", rows)
    version, ds_keys = _deepspeed_keys()
    all_ds = set(ds_keys) | set(DEEPSPEED_KEYS) | {p for p in rows if "." not in p and p in DEEPSPEED_KEYS}
    from dscore.config.model import CORE_KEYS

    all_ds |= {k for k in CORE_KEYS if k in rows and not _dscore_only(k)}
    for path in sorted(all_ds):
        if path in rows:
            r = rows[path]
            rows[path] = AuditRow(r.path, r.status, r.detail, True, True)
            continue
        top = path.split(".")[0]
        info = ds_keys.get(path, {})
        gated_block = next((b for b in _GATED_BLOCKS if path == b or path.startswith(b + ".")), None)
        if top in aliases:
            rows[path] = AuditRow(path, "migrated", f"another spelling of {aliases[top]!r}", True, False)
        elif gated_block is not None:
            rows[path] = AuditRow(path, "refused", _GATED_BLOCKS[gated_block], True, False)
        elif top in GATED_KEYS:
            policy = GATED_KEYS[top]
            what = "removed in DeepSpeed 0.19.8" if policy.removed else "not implemented"
            rows[path] = AuditRow(path, "refused", f"{policy.feature} ({what}): refused when on, warned when off", True, False)
        elif top in IGNORED_KEYS:
            rows[path] = AuditRow(path, "warned", IGNORED_KEYS[top], True, False)
        elif info.get("deprecated"):
            new = info["deprecated"]
            target = f" (use {new})" if isinstance(new, str) else ""
            rows[path] = AuditRow(path, "migrated", f"deprecated in DeepSpeed{target}: migrated or refused at load", True, False)
        elif info.get("block"):
            rows[path] = AuditRow(path, "unknown", "block dscore has no model for: refused as an unknown key", True, False)
        else:
            rows[path] = AuditRow(path, "unknown", "no dscore field: refused as an unknown key", True, False)
    return version, [rows[k] for k in sorted(rows)]


#: nested DeepSpeed blocks a section's ``migrate_legacy`` gates as a whole (dropped when inert, else refused)
_GATED_BLOCKS = {
    "zero_optimization.zenflow": "ZenFlow is not implemented: dropped with a warning when inert, refused otherwise "
    "(ZeroConfig.migrate_legacy)",
}


def _dscore_only(key: str) -> bool:
    return key in {"plugins", "strict", "dscore"}


def unread_fields(rows: list[AuditRow]) -> list[AuditRow]:
    """The rows of model fields read nowhere and not marked (keys accepted and ignored)."""
    return [r for r in rows if r.status == "unread"]


def render_markdown(version: str, rows: list[AuditRow]) -> str:
    """The ``docs/config-keys.md`` text."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [
        "# Config keys: what dscore does with each",
        "",
        f"Generated by `{REGENERATE}` from dscore's config models and DeepSpeed {version}'s key list",
        "(`dscore/config/deepspeed_keys.json`, written by `tools/dump_deepspeed_keys.py`). Do not edit by hand.",
        "",
        "Status: **implemented** (where the value is read), **warned** (accepted; setting it logs a warning with",
        "the reason), **refused** (a value that would change training is a `ConfigError`), **migrated** (a",
        "deprecated DeepSpeed spelling rewritten at load), **unknown** (a DeepSpeed key dscore has no field for:",
        "refused as an unknown key, a warning with `\"strict\": false`), **block** (a section; see its keys).",
        "Optimizer and scheduler `params` are validated per type by their plugins and are not listed.",
        "",
        "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        "",
        "| key | DeepSpeed | dscore | status | where / why |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        lines.append(
            f"| `{r.path}` | {'yes' if r.deepspeed else ''} | {'yes' if r.dscore else ''} | {r.status} | {detail} |"
        )
    return "\n".join(lines) + "\n"


def statuses(text: str) -> dict[str, tuple[str, str, str]]:
    """``{key: (deepspeed, dscore, status)}`` read back from a rendered document (the *where* column is left
    out: it lists the first files reading a name and drifts as code moves, without any key changing)."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) >= 5 and cells[0].startswith("| `") and cells[0].endswith("`"):
            out[cells[0][3:-1]] = (cells[1], cells[2], cells[3])
    return out


def stale_keys(current: str, version: str, rows: list[AuditRow]) -> list[str]:
    """Keys whose presence or status differs between the document text ``current`` and the audit."""
    want, have = statuses(render_markdown(version, rows)), statuses(current)
    return sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))


def main(argv: list[str] | None = None) -> int:
    """``python -m dscore.config.audit [--write | --check]`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m dscore.config.audit", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"regenerate {_relative(DOC_PATH)}")
    group.add_argument("--check", action="store_true", help="exit 1 on an unread field or a stale document")
    args = parser.parse_args(argv)
    version, rows = audit()
    text = render_markdown(version, rows)
    unread = unread_fields(rows)
    for r in unread:
        sys.stderr.write(f"unread config field {r.path}: {r.detail}\n")
    if args.write:
        DOC_PATH.write_text(text, encoding="utf-8")
        sys.stderr.write(f"wrote {DOC_PATH} ({len(rows)} keys)\n")
        return 1 if unread else 0
    if args.check:
        stale = stale_keys(DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else "", version, rows)
        if stale:
            sys.stderr.write(f"{_relative(DOC_PATH)} is out of date for {', '.join(stale)}: run {REGENERATE}\n")
        return 1 if unread or stale else 0
    sys.stdout.write(text)
    return 1 if unread else 0


if __name__ == "__main__":
    raise SystemExit(main())
