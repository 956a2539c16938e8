"""``deepspeed.launcher.runner``: the ``deepspeed`` console script is ``dscore run`` (same flags:
``--num_gpus``, ``--num_nodes``, ``--hostfile``, ``--include``/``--exclude``, ``--master_port``, the
launchers), and ``DEEPSPEED_ENVIRONMENT_NAME`` is the environment file both read (``.deepspeed_env``).

DeepSpeed's helper functions are here with their signatures and return types, over dscore's launcher:
hostfiles parse with :func:`dscore.launcher.hostfile.parse_hostfile_text` (stricter: see its module), filters
with :func:`dscore.launcher.resources.parse_filter`. Bad input raises a dscore error that is a ``ValueError``
(:class:`~dscore.errors.HostfileError`, :class:`~dscore.errors.LauncherArgumentError`), as DeepSpeed raises
``ValueError``.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from dscore.errors import LauncherArgumentError
from dscore.launcher.envfile import ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME
from dscore.launcher.hostfile import DEFAULT_HOSTFILE as DLTS_HOSTFILE
from dscore.launcher.hostfile import parse_hostfile, parse_hostfile_text
from dscore.launcher.node import encode_world_info as _encode_world_info
from dscore.launcher.resources import parse_filter

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DLTS_HOSTFILE",
    "apply_num_nodes_and_gpus",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]

log = logging.getLogger("deepspeed.launcher.runner")


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``deepspeed`` command-line flags (``sys.argv[1:]`` when ``args`` is None).

    The options are ``dscore run``'s (:func:`dscore.launcher.options.add_arguments`); unlike ``dscore run`` and
    like DeepSpeed's parser, unambiguous abbreviations (``--launcher_arg``) are accepted. ``hostfile`` is None
    when ``-H`` is not given (the implicit ``/job/hostfile``).
    """
    from dscore.launcher.options import add_arguments

    parser = argparse.ArgumentParser(
        prog="dscore run", description="launch a multi-node/multi-accelerator training job (deepspeed is dscore run)"
    )
    add_arguments(parser)
    return parser.parse_args(args=None if args is None else list(args))


def _parse_hostfile(hostfile_lines: Iterable[str]) -> collections.OrderedDict[str, int]:
    """Hostfile lines (with or without line ends) -> ``OrderedDict(host -> slots)`` in file order.

    The key is ``user@host`` when the line names a user, as DeepSpeed keys it.

    Raises:
        HostfileError (a ValueError): a malformed line, a duplicate host, or no host.
    """
    text = "\n".join(line.rstrip("\r\n") for line in hostfile_lines)
    return collections.OrderedDict((h.target, h.slots) for h in parse_hostfile_text(text))


def fetch_hostfile(hostfile_path: str) -> collections.OrderedDict[str, int] | None:
    """Read the hostfile at ``hostfile_path``; None (and a warning) when there is no such file, as DeepSpeed.

    Raises:
        HostfileError (a ValueError): the file is unreadable or malformed.
    """
    if not os.path.isfile(hostfile_path):
        log.warning("no hostfile at %s; using local resources only", hostfile_path)
        return None
    return collections.OrderedDict((h.target, h.slots) for h in parse_hostfile(hostfile_path))


def _dedupe(slots: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(slots))


def parse_resource_filter(
    host_info: Mapping[str, list[int]], include_str: str = "", exclude_str: str = ""
) -> Mapping[str, list[int]]:
    """Filter ``host_info`` (host -> slot list) by an include or exclude string ``host[:s,s][@host...]``.

    Returns ``host_info`` itself when both are empty, else an ``OrderedDict`` in ``host_info`` order: include
    keeps the named hosts (a bare host with all its slots, else the named slots, sorted); exclude drops bare
    hosts and named slots. Hosts left without slots are dropped, so the result may be empty (as DeepSpeed's).

    Raises:
        LauncherArgumentError (a ValueError): both strings given, an unknown host or slot, a malformed entry.
    """
    if include_str and exclude_str:
        raise LauncherArgumentError(
            f"include_str {include_str!r} and exclude_str {exclude_str!r} are mutually exclusive; pass one of them"
        )
    if not include_str and not exclude_str:
        return host_info
    pool = {h: list(s) for h, s in host_info.items()}
    named = parse_filter(include_str or exclude_str, pool, option="--include" if include_str else "--exclude")
    out: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
    for host, slots in pool.items():
        if include_str:
            if host not in named:
                continue
            chosen = named[host]
            kept = _dedupe(slots) if chosen is None else list(chosen)
        else:
            removed = named.get(host, [])
            kept = [] if removed is None else [s for s in _dedupe(slots) if s not in removed]
        if kept:
            out[host] = kept
    return out


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> Mapping[str, list[int]]:
    """``resource_pool`` (host -> slot count) as host -> ``[0..count)``, filtered by :func:`parse_resource_filter`."""
    active = collections.OrderedDict((h, list(range(n))) for h, n in resource_pool.items())
    return parse_resource_filter(active, include_str=inclusion, exclude_str=exclusion)


def apply_num_nodes_and_gpus(
    active_resources: Mapping[str, list[int]], num_nodes: int, num_gpus: int
) -> Mapping[str, list[int]]:
    """Keep the first ``num_nodes`` hosts (when > 0) and make every host's slots ``[0..num_gpus)`` (when > 0)."""
    result = collections.OrderedDict(active_resources)
    if num_nodes > 0:
        result = collections.OrderedDict(list(result.items())[:num_nodes])
    if num_gpus > 0:
        result = collections.OrderedDict((h, list(range(num_gpus))) for h in result)
    return result


def encode_world_info(world_info: Mapping[str, Sequence[int]] | Mapping[str, int]) -> str:
    """URL-safe base64 of ``json.dumps(world_info)`` (the ``--world_info`` value the node launcher reads).

    Values are encoded as given (DeepSpeed's tests pass slot counts as well as slot lists).
    """
    if all(not isinstance(v, int) for v in world_info.values()):
        return _encode_world_info(world_info)  # type: ignore[arg-type]
    return base64.urlsafe_b64encode(json.dumps(dict(world_info)).encode("utf-8")).decode("ascii")


def main(args: Sequence[str] | None = None) -> int:
    """``deepspeed [launcher flags] script.py [script args]``: ``dscore run``; returns the job's exit code.

    Raises:
        LauncherArgumentError, HostfileError (ValueErrors): conflicting or invalid flags (``--num_nodes`` or
            ``--num_gpus`` with ``--include``/``--exclude``, an unknown host or slot), a bad hostfile.
        LauncherError: the job cannot be started as asked (busy ``--master_port``, missing back end, ...).
    """
    from dscore.cli.run import run

    logging.basicConfig(level=logging.INFO, format="[dscore] %(levelname)s %(message)s")
    return int(run(parse_args(sys.argv[1:] if args is None else args)) or 0)


def cli_main() -> int:
    """The ``deepspeed`` console script: :func:`main`, with a dscore error printed as one line (exit 2, no
    traceback: the same as ``dscore run``) and Ctrl-C as exit 130. Programmatic callers use :func:`main`,
    which raises as DeepSpeed's does."""
    from dscore.errors import DscoreError

    try:
        return main()
    except DscoreError as exc:
        print(f"deepspeed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli_main())
