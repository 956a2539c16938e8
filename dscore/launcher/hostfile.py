"""Hostfile parsing (``-H/--hostfile``).

Grammar, one host per line::

    # comment
    node-a slots=4          # trailing comment
    user@node-b   slots=2   max_slots=8

Blank lines and whitespace-only lines are ignored, ``#`` starts a comment anywhere, fields are separated
by any run of spaces or tabs. The first field is ``host`` or ``user@host``; the second must be
``slots=N`` with ``N >= 1``; further fields must be OpenMPI-style ``key=value`` attributes (ignored).

Differences from DeepSpeed's ``_parse_hostfile`` (which prefix-matches ``^(\\S+)\\s+slots=(\\d+)``): trailing
junk that is not ``key=value`` and ``slots=0`` are rejected instead of silently accepted, and every
error names the file, the line number and the expected form. As in DeepSpeed, a duplicate host or a
file without hosts is an error, and host order is the order of first appearance.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from dscore.errors import HostfileError

__all__ = ["DEFAULT_HOSTFILE", "Host", "parse_hostfile", "parse_hostfile_text", "load_hostfile"]

log = logging.getLogger("dscore.launcher.hostfile")

#: DeepSpeed's default ``--hostfile``; only this implicit path may be missing.
DEFAULT_HOSTFILE = "/job/hostfile"

EXPECTED_FORM = "expected 'host slots=N' or 'user@host slots=N' (N >= 1), optionally followed by '# comment'"

_HOST_RE = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<host>[A-Za-z0-9_.:\[\]-]+)$")
_SLOTS_RE = re.compile(r"^slots=(?P<n>\d+)$")
_ATTR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S+$")


@dataclass(frozen=True)
class Host:
    """One hostfile entry.

    Attributes:
        name: the host name as other nodes and filters refer to it (without ``user@``).
        slots: number of process slots (accelerators, or processes on CPU), >= 1.
        user: the ssh login name from ``user@host``, or ``None``.
        line: 1-based line number in the hostfile (0 when not from a file).
    """

    name: str
    slots: int
    user: str | None = None
    line: int = 0

    @property
    def target(self) -> str:
        """``user@host`` for ssh/pdsh when a user was given, else ``host``."""
        return f"{self.user}@{self.name}" if self.user else self.name


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> list[Host]:
    """Parse hostfile ``text``; ``path`` is only used in error messages.

    Returns:
        The hosts in file order.

    Raises:
        HostfileError: a malformed line (with ``path``, ``line`` and the expected form), a duplicate host
            (naming both lines), or no host at all.
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        host_match = _HOST_RE.match(fields[0])
        slots_match = _SLOTS_RE.match(fields[1]) if len(fields) > 1 else None
        bad_attr = [f for f in fields[2:] if not _ATTR_RE.match(f)]
        if host_match is None or slots_match is None or bad_attr:
            raise HostfileError(
                f"{path}:{number}: bad hostfile entry {raw.strip()!r}; {EXPECTED_FORM}", path=path, line=number
            )
        slots = int(slots_match.group("n"))
        if slots < 1:
            raise HostfileError(
                f"{path}:{number}: host {host_match.group('host')!r} has slots={slots}; {EXPECTED_FORM}",
                path=path,
                line=number,
            )
        name = host_match.group("host")
        if name in seen:
            raise HostfileError(
                f"{path}:{number}: host {name!r} is listed twice (first on line {seen[name]}); "
                "each host may appear once",
                path=path,
                line=number,
            )
        seen[name] = number
        hosts.append(Host(name=name, slots=slots, user=host_match.group("user"), line=number))
    if not hosts:
        raise HostfileError(f"{path}: no hosts found; {EXPECTED_FORM}", path=path, line=0)
    return hosts


def parse_hostfile(path: str | os.PathLike[str]) -> list[Host]:
    """Read and parse the hostfile at ``path``.

    Raises:
        HostfileError: the file cannot be read, or see :func:`parse_hostfile_text`.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise HostfileError(f"hostfile {path!r} cannot be read: {exc.strerror or exc}", path=path) from exc
    return parse_hostfile_text(text, path)


def load_hostfile(path: str | None) -> list[Host] | None:
    """Resolve ``-H/--hostfile``: ``None`` means the implicit default :data:`DEFAULT_HOSTFILE`.

    Only the implicit default may be missing: then ``None`` is returned (local resources are used) and
    a log line says so, like DeepSpeed. An explicitly passed path that does not exist is an error
    (DeepSpeed silently falls back to local resources there).

    Raises:
        HostfileError: an explicit hostfile is missing or unreadable, or any hostfile is malformed.
    """
    if path is None:
        if not os.path.exists(DEFAULT_HOSTFILE):
            log.info("no hostfile at %s (the default); using local resources only", DEFAULT_HOSTFILE)
            return None
        return parse_hostfile(DEFAULT_HOSTFILE)
    if not os.path.isfile(path):
        raise HostfileError(
            f"hostfile {path!r} (from -H/--hostfile) does not exist or is not a file; pass an existing "
            f"hostfile or omit -H to launch on local resources",
            path=path,
        )
    return parse_hostfile(path)
