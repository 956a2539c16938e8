"""Reading a ds_config from any of the sources DeepSpeed accepts.

* a ``dict`` (copied; never mutated),
* a path (``str`` or :class:`pathlib.Path`) to a JSON or Hjson file (comments, trailing commas and
  unquoted keys allowed); a key given twice in one object is an error,
* url-safe base64 text of such a document (what launchers pass on the command line),
* an :class:`argparse.Namespace` from :func:`dscore.config.add_config_arguments`: its
  ``deepspeed_config`` or the deprecated ``deepscale_config`` (giving both is an error naming both).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import logging
import os
import pathlib
import re
from typing import Any

import hjson

from dscore.errors import ConfigError

__all__ = ["read_source", "parse_text"]

log = logging.getLogger("dscore.config")

_BASE64 = re.compile(r"^[A-Za-z0-9_\-+/]+={0,2}$")


def _pairs_hook(source: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        duplicates: list[str] = []
        for key, value in pairs:
            if key in out and key not in duplicates:
                duplicates.append(key)
            out[key] = value
        if duplicates:
            raise ConfigError(
                f"{source}: duplicate keys in ds_config: {duplicates} (each key may appear once per object)",
                path=duplicates[0],
                source=source,
            )
        return out

    return hook


def parse_text(text: str, *, source: str) -> dict[str, Any]:
    """Parse JSON/Hjson ``text`` into a dict, rejecting duplicate keys.

    Raises:
        ConfigError: syntax error (with line and column), a duplicate key, or a document that is not an
            object.
    """
    try:
        data = hjson.loads(text, object_pairs_hook=_pairs_hook(source))
    except ConfigError:
        raise
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(
            f"{source}: not valid JSON/Hjson at line {exc.lineno}, column {exc.colno}: {exc.msg}",
            source=source,
        ) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(f"{source}: not valid JSON/Hjson: {exc}", source=source) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: a ds_config must be a JSON object at the top level, got {type(data).__name__}",
            source=source,
        )
    return data


def _read_file(path: pathlib.Path, source: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})", source=source) from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the ds_config file: {exc.strerror or exc}", source=source) from None
    return parse_text(text, source=source)


def _decode_base64(text: str) -> str | None:
    candidate = "".join(text.split())
    if not candidate or not _BASE64.match(candidate):
        return None
    candidate = candidate.rstrip("=")
    candidate += "=" * (-len(candidate) % 4)
    try:
        raw = base64.urlsafe_b64decode(candidate.replace("+", "-").replace("/", "_"))
        return raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def _from_namespace(args: argparse.Namespace, source_name: str | None) -> tuple[dict[str, Any], str, list[str]]:
    ds = getattr(args, "deepspeed_config", None)
    legacy = getattr(args, "deepscale_config", None)
    warnings: list[str] = []
    if ds is not None and legacy is not None:
        raise ConfigError(
            f"two ds_config sources given at once: --deepspeed_config {ds!r} and the deprecated "
            f"--deepscale_config {legacy!r}; pass only --deepspeed_config",
            path="deepspeed_config",
            source="<args>",
        )
    if legacy is not None:
        warnings.append("--deepscale_config is deprecated; use --deepspeed_config (same meaning)")
        ds = legacy
    if ds is None:
        raise ConfigError(
            "no ds_config given: pass --deepspeed_config FILE (args.deepspeed_config is None)",
            path="deepspeed_config",
            source="<args>",
        )
    data, name, more = read_source(ds, source_name=source_name)
    return data, name, warnings + more


def read_source(source: Any, *, source_name: str | None = None) -> tuple[dict[str, Any], str, list[str]]:
    """Read ``source`` into a fresh dict.

    Args:
        source: dict, ``str`` path, :class:`pathlib.Path`, url-safe base64 ``str``, or
            :class:`argparse.Namespace` (``deepspeed_config`` / ``deepscale_config``).
        source_name: name used in messages instead of the derived one.

    Returns:
        ``(data, source_name, warnings)``.

    Raises:
        ConfigError: unreadable or unparsable source, a missing file, two sources at once, or a type
            that is not a config source.
    """
    if isinstance(source, argparse.Namespace):
        return _from_namespace(source, source_name)
    if isinstance(source, dict):
        return _copy(source), source_name or "<dict>", []
    if isinstance(source, os.PathLike):
        path = pathlib.Path(source)
        name = source_name or str(path)
        if not path.is_file():
            raise ConfigError(f"{name}: ds_config file not found", source=name)
        return _read_file(path, name), name, []
    if isinstance(source, str):
        if source and os.path.isfile(source):
            name = source_name or source
            return _read_file(pathlib.Path(source), name), name, []
        decoded = _decode_base64(source)
        if decoded is not None:
            name = source_name or "<base64>"
            try:
                return parse_text(decoded, source=name), name, []
            except ConfigError:
                if not _looks_like_path(source):
                    raise
        shown = source if len(source) <= 120 else source[:117] + "..."
        raise ConfigError(
            f"expected a path to an existing ds_config file, a dict, or url-safe base64 of a JSON object; "
            f"received {shown!r} (no such file, and not base64 of a JSON object)",
            source=source_name or shown,
        )
    raise ConfigError(
        f"cannot read a ds_config from a {type(source).__name__}; expected a dict, a str or pathlib.Path path, "
        "url-safe base64 text, or an argparse.Namespace with deepspeed_config",
        source=source_name or f"<{type(source).__name__}>",
    )


def _looks_like_path(text: str) -> bool:
    return os.sep in text or text.endswith((".json", ".hjson"))


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value
