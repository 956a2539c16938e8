"""``deepspeed.utils``: ``logger``, the ZeRO-3 leaf-module helpers (``set_z3_leaf_modules``, ...) and ``groups``.

``logger`` is dscore's logger (``logging.getLogger("dscore")``): integrations set its level (Trainer does
``deepspeed.utils.logger.setLevel(...)``) and that governs dscore's messages. The leaf-module helpers are
dscore's (``dscore.zero``), imported when first used; ``groups`` maps DeepSpeed's group accessors onto
:mod:`dscore.parallel.groups`.
"""

from __future__ import annotations

from typing import Any

from deepspeed.utils.logging import log_dist, logger

__all__ = [
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "set_z3_leaf_modules",
    "torch",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

_LEAF_NAMES = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module")


def __getattr__(name: str) -> Any:
    if name in _LEAF_NAMES:
        import dscore.zero

        value = getattr(dscore.zero, name, None)
        if value is None:
            from dscore.errors import ConfigError

            raise ConfigError(
                f"deepspeed.utils.{name}: this dscore installation has no ZeRO-3 leaf modules "
                f"(dscore.zero.{name} is missing); upgrade dscore"
            )
        return value
    if name in ("zero_to_fp32", "logging", "groups", "torch"):
        from importlib import import_module

        return import_module(f"deepspeed.utils.{name}")
    raise AttributeError(f"deepspeed.utils.{name} is not provided by dscore's compatibility layer")
