"""Environment exported to remote nodes, and quoting it for the remote shell.

What is exported (DeepSpeed's rules, 0.19.8):

* every variable of the launcher's environment whose name starts with one of :data:`EXPORT_PREFIXES`
  (``NCCL``, ``PYTHON``, ``MV2``, ``UCX``, ``MLFLOW``) or one of the accelerator's ``export_envs()``;
* ``PYTHONPATH`` is prefixed with the launcher's working directory;
* ``.deepspeed_env`` from the home directory, then from the working directory (later files override
  earlier ones). ``DS_ENV_FILE`` names one explicit file instead (it must exist).

``.deepspeed_env`` lines are ``NAME=VALUE``, split on the first ``=`` only (``EXTRA_FLAGS=--opt=1,--mode=fast``
keeps its value), CRLF line ends tolerated, blank and ``#`` lines skipped. A line without ``=`` or with an
invalid name is a :class:`~dscore.errors.LauncherError` naming the file and line (DeepSpeed crashes with
a bare ``ValueError``).

Remote expansion rule (what DeepSpeed users' files expect, made safe): in a ``.deepspeed_env`` value,
``$NAME`` and ``${NAME}`` are variable references **expanded on the remote node** (so
``LD_LIBRARY_PATH=/opt/efa/lib:$LD_LIBRARY_PATH`` prepends to the remote node's own path). Nothing else
is interpreted: ``$(...)``, backquotes, ``;``, ``|``, ``&``, quotes, backslashes, ``${NAME:-x}`` and a
lone ``$`` stay literal characters of the value, so a value cannot run a command. An undefined
reference expands to the empty string, as in a shell. The older explicit form ``NAME=@expand:VALUE`` is
still accepted and means the same (the marker is dropped). Values taken from the launcher's own
environment (``NCCL_*``, ``PYTHON*``, ...) are real values and are never expanded.

How each back end applies the rule: the shell-based runners (pdsh, ssh) export such values in double
quotes in which only the references are active and every other ``$``, backquote, backslash and double
quote is escaped (:func:`shell_export`); the MPI-style runners (openmpi, mpich, mvapich, slurm) pass the
value unchanged and the per-rank entry (``python -m dscore.launcher.node --mpi --expand_env NAME``)
expands it on the node with :func:`expand_references`, without any shell.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dscore.errors import LauncherError

log = logging.getLogger("dscore.launcher")

__all__ = [
    "EXPORT_PREFIXES",
    "ENV_FILE_NAME",
    "EXPAND_MARKER",
    "EnvVar",
    "parse_env_file",
    "collect_exports",
    "shell_export",
    "expand_references",
    "has_references",
]

#: Prefixes of launcher environment variables exported to every node.
EXPORT_PREFIXES: tuple[str, ...] = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW")
#: Default file name of the per-user/per-project export list (DeepSpeed's name).
ENV_FILE_NAME = ".deepspeed_env"
#: Value prefix that asks for ``$VAR`` expansion on the remote side.
EXPAND_MARKER = "@expand:"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VAR_REF_RE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")


@dataclass(frozen=True)
class EnvVar:
    """One exported variable.

    Attributes:
        name: variable name.
        value: the value (without the :data:`EXPAND_MARKER`).
        expand: True when ``value`` holds ``$NAME``/``${NAME}`` references, expanded on the remote node
            (always False for values taken from the launcher's environment).
        source: where it came from (``"environment"`` or ``"<file>:<line>"``).
    """

    name: str
    value: str
    expand: bool = False
    source: str = "environment"


def parse_env_file(path: str) -> list[EnvVar]:
    """Parse one ``.deepspeed_env``-style file.

    Raises:
        LauncherError: unreadable file, a non-blank non-comment line without ``=``, or an invalid name;
            the message names the file and the 1-based line.
    """
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except OSError as exc:
        raise LauncherError(f"environment file {path!r} cannot be read: {exc.strerror or exc}") from exc
    out: list[EnvVar] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep:
            raise LauncherError(f"{path}:{number}: {stripped!r} has no '='; expected NAME=VALUE")
        if not _NAME_RE.match(name):
            raise LauncherError(
                f"{path}:{number}: {name!r} is not a valid variable name; expected NAME=VALUE with NAME "
                "matching [A-Za-z_][A-Za-z0-9_]*"
            )
        marked = value.startswith(EXPAND_MARKER)
        if marked:
            value = value[len(EXPAND_MARKER) :]
        out.append(EnvVar(name, value, has_references(value), f"{path}:{number}"))
    return out


def _env_files(environ: Mapping[str, str], cwd: str, home: str) -> list[str]:
    explicit = environ.get("DS_ENV_FILE")
    if explicit:
        if not os.path.isfile(explicit):
            raise LauncherError(
                f"DS_ENV_FILE={explicit!r} does not exist or is not a file; unset it to read "
                f"{ENV_FILE_NAME} from {home} and {cwd}"
            )
        return [explicit]
    found: list[str] = []
    for directory in (home, cwd):
        path = os.path.join(directory, ENV_FILE_NAME)
        if os.path.isfile(path) and os.path.realpath(path) not in [os.path.realpath(p) for p in found]:
            found.append(path)
    return found


_AISC_NODE_LOCAL = ("NCCL_IB_HCA", "UCX_NET_DEVICES")


def collect_exports(
    environ: Mapping[str, str],
    *,
    cwd: str,
    home: str | None = None,
    extra_prefixes: Iterable[str] = (),
) -> list[EnvVar]:
    """Variables to export to remote nodes, in a stable order (environment first, then files).

    Args:
        environ: the launcher's environment.
        cwd: the working directory (prefixed to ``PYTHONPATH``; its ``.deepspeed_env`` is read).
        home: the home directory (default ``~``).
        extra_prefixes: the accelerator's ``export_envs()`` prefixes.

    Raises:
        LauncherError: a bad environment file (see :func:`parse_env_file`) or a missing ``DS_ENV_FILE``.
    """
    home = os.path.expanduser("~") if home is None else home
    prefixes = tuple(EXPORT_PREFIXES) + tuple(p for p in extra_prefixes if p not in EXPORT_PREFIXES)
    merged: dict[str, EnvVar] = {}
    # DeepSpeed's runner: on AISC (AISC_JOB_NAME set) the node-specific NIC choices are not exported
    skip = _AISC_NODE_LOCAL if environ.get("AISC_JOB_NAME") else ()
    for name in sorted(environ):
        if name.startswith(prefixes) and name not in skip:
            merged[name] = EnvVar(name, environ[name])
    if skip and any(n in environ for n in skip):
        left = ", ".join(n for n in skip if n in environ)
        log.info("AISC_JOB_NAME is set: %s not exported to other nodes (as DeepSpeed)", left)
    pythonpath = environ.get("PYTHONPATH", "")
    merged["PYTHONPATH"] = EnvVar("PYTHONPATH", f"{cwd}:{pythonpath}" if pythonpath else cwd)
    for path in _env_files(environ, cwd, home):
        for var in parse_env_file(path):
            merged.pop(var.name, None)
            merged[var.name] = var
    return list(merged.values())


def has_references(value: str) -> bool:
    """True when ``value`` contains a ``$NAME`` or ``${NAME}`` reference (the remote-expansion rule)."""
    return _VAR_REF_RE.search(value) is not None


def expand_references(value: str, environ: Mapping[str, str]) -> str:
    """Replace ``$NAME``/``${NAME}`` in ``value`` with ``environ``'s values (empty when undefined).

    Everything else is kept literally (no command substitution, no ``${NAME:-default}``): the same
    result a POSIX shell gives for the double-quoted form :func:`shell_export` writes.
    """

    def sub(match: re.Match[str]) -> str:
        return environ.get(match.group(0).lstrip("$").strip("{}"), "")

    return _VAR_REF_RE.sub(sub, value)


def _double_quote_expanding(value: str) -> str:
    pieces: list[str] = []
    pos = 0
    for match in _VAR_REF_RE.finditer(value):
        pieces.append(_escape_dq(value[pos : match.start()]))
        pieces.append(match.group(0))
        pos = match.end()
    pieces.append(_escape_dq(value[pos:]))
    return '"' + "".join(pieces) + '"'


def _escape_dq(text: str) -> str:
    return "".join("\\" + c if c in '\\"`$' else c for c in text)


def shell_export(var: EnvVar) -> str:
    """``export NAME=<quoted value>`` for a POSIX remote shell.

    Plain values are single-quoted (:func:`shlex.quote`): nothing in them is interpreted. Values with
    references (``var.expand``) are double-quoted with only ``$NAME``/``${NAME}`` left active.
    """
    value = _double_quote_expanding(var.value) if var.expand else shlex.quote(var.value)
    return f"export {var.name}={value}"
