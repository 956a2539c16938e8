"""``add_config_arguments(parser)``: DeepSpeed's four command-line flags, the local-rank flag, plus the plugins' own.

Like ``deepspeed.add_config_arguments`` it adds an argument group titled ``DeepSpeed`` with
``--deepspeed`` (a helper flag scripts may test; dscore never reads it), ``--deepspeed_config FILE`` and
the deprecated ``--deepscale`` / ``--deepscale_config``, then lets every active plugin add flags through
the ``dscore_add_config_arguments`` hook of a fresh plugin manager.

Unlike DeepSpeed it also adds ``--local_rank`` / ``--local-rank`` when the parser has neither: ``dscore
run`` (like the ``deepspeed`` launcher and ``torch.distributed.launch``) passes ``--local_rank=N`` to every
process, and a script written from the README template would otherwise fail with "unrecognized
arguments". A script that declares one spelling itself keeps its own flag; the other spelling is added
as a hidden alias of it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

__all__ = ["add_config_arguments", "add_local_rank_argument"]

_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def _env_local_rank(environ: Mapping[str, str]) -> int:
    text = environ.get("LOCAL_RANK", "").strip()
    if not text:
        return -1
    try:
        return int(text)
    except ValueError:
        from dscore.errors import ConfigError

        raise ConfigError(
            f"LOCAL_RANK={text!r} in the environment is not an integer (the launcher sets it to the process's "
            "index on its node); unset it or set it to 0, 1, ..."
        ) from None


def add_local_rank_argument(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Make ``parser`` accept ``--local_rank N`` and ``--local-rank N`` (dest ``local_rank``, int).

    The default is ``$LOCAL_RANK`` when set (``torchrun`` and ``dscore run --no_local_rank`` pass the rank
    only there), else ``-1`` (the value DeepSpeed's and torch's examples use for "not launched").
    When the parser already has one spelling, only the other is added, as a hidden alias writing to the
    existing flag's dest; when it has both, nothing changes.

    Raises:
        ConfigError: ``LOCAL_RANK`` is set but is not an integer.
    """
    existing = [parser._option_string_actions[f] for f in _LOCAL_RANK_FLAGS if f in parser._option_string_actions]
    if len(existing) == len(_LOCAL_RANK_FLAGS):
        return
    if existing:
        own = existing[0]
        if not isinstance(own, argparse._StoreAction):  # a flag of the script's own making: leave it be
            return
        missing = [f for f in _LOCAL_RANK_FLAGS if f not in own.option_strings]
        parser.add_argument(*missing, dest=own.dest, type=own.type or int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return
    parser.add_argument(
        *_LOCAL_RANK_FLAGS,
        dest="local_rank",
        type=int,
        default=_env_local_rank(os.environ if environ is None else environ),
        metavar="N",
        help="this process's index on its node; passed by `dscore run` (default: $LOCAL_RANK, else -1)",
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the DeepSpeed config flags to ``parser`` and return the same parser.

    Flags (defaults as DeepSpeed): ``--deepspeed`` (store_true, False), ``--deepspeed_config`` (str,
    None), ``--deepscale`` (store_true, False, deprecated), ``--deepscale_config`` (str, None, deprecated;
    :func:`dscore.config.load_config` moves it to ``deepspeed_config`` with a warning and refuses both
    at once). Outside that group, ``--local_rank``/``--local-rank`` (int, dest ``local_rank``) when the
    parser lacks them: see :func:`add_local_rank_argument`.

    Raises:
        argparse.ArgumentError: a DeepSpeed flag already exists on ``parser`` (argparse's own conflict check).
        ConfigError: ``LOCAL_RANK`` is set but is not an integer.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configurations (dscore)")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable dscore/DeepSpeed (a flag for the script's own use; dscore does not read it)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="Path to the ds_config JSON/Hjson file (or base64 text)"
    )
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated alias of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated alias of --deepspeed_config")
    add_local_rank_argument(parser)
    from dscore.plugin_manager import create_plugin_manager

    create_plugin_manager().call("dscore_add_config_arguments", parser=parser)
    return parser
