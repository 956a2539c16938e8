"""``add_config_arguments(parser)``: DeepSpeed's four command-line flags, plus the plugins' own.

Like ``deepspeed.add_config_arguments`` it adds an argument group titled ``DeepSpeed`` with
``--deepspeed`` (a helper flag scripts may test; dscore never reads it), ``--deepspeed_config FILE`` and
the deprecated ``--deepscale`` / ``--deepscale_config``, then lets every active plugin add flags through
the ``dscore_add_config_arguments`` hook of a fresh plugin manager.
"""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the DeepSpeed config flags to ``parser`` and return the same parser.

    Flags (defaults as DeepSpeed): ``--deepspeed`` (store_true, False), ``--deepspeed_config`` (str,
    None), ``--deepscale`` (store_true, False, deprecated), ``--deepscale_config`` (str, None, deprecated;
    :func:`dscore.config.load_config` moves it to ``deepspeed_config`` with a warning and refuses both
    at once).

    Raises:
        argparse.ArgumentError: a flag already exists on ``parser`` (argparse's own conflict check).
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
    from dscore.plugin_manager import create_plugin_manager

    create_plugin_manager().call("dscore_add_config_arguments", parser=parser)
    return parser
