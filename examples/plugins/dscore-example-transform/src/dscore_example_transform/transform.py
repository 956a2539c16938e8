"""The ``freeze`` model transform (imports torch only when it runs)."""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING

from dscore.errors import ConfigError
from dscore.protocols import ModelTransform, TransformContext

if TYPE_CHECKING:
    from dscore.config import DscoreConfig
    from dscore_example_transform.config import FreezeConfig

__all__ = ["FreezeTransform"]

log = logging.getLogger("dscore_example_transform")


class FreezeTransform(ModelTransform["FreezeConfig"]):
    """Sets ``requires_grad = False`` on every parameter whose name matches one of ``freeze.patterns``, so the
    optimizer and the ZeRO stage never see them (``dscore.initialize`` keeps only trainable parameters)."""

    def enabled(self, config: DscoreConfig) -> bool:
        """``freeze.enabled``."""
        section = config.section("freeze", None)
        return section is not None and bool(section.enabled)

    def apply(self, ctx: TransformContext[FreezeConfig]) -> None:
        """Freeze the matching parameters in place.

        Raises:
            ConfigError: a pattern matches no parameter (path ``freeze.patterns``).
        """
        names = [name for name, _ in ctx.model.named_parameters()]
        for pattern in ctx.section.patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ConfigError(
                    f"freeze.patterns: {pattern!r} matches no parameter of the model (it has {', '.join(names)})",
                    path="freeze.patterns",
                )
        frozen = []
        for name, param in ctx.model.named_parameters():
            if any(fnmatch.fnmatchcase(name, p) for p in ctx.section.patterns):
                param.requires_grad_(False)
                frozen.append(name)
        log.info("froze %d parameter(s): %s", len(frozen), ", ".join(frozen))
