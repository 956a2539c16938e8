"""The errors :class:`dscore.runtime.engine.DscoreEngine` raises (importable without the engine itself, so the
engine's helpers such as :mod:`dscore.runtime.offload_states` need not import the engine module)."""

from __future__ import annotations

from dscore.errors import DscoreError

__all__ = ["EngineAPIMissing", "EngineError"]


class EngineError(DscoreError, RuntimeError):
    """The engine was used in a way it does not support (backward without an optimizer, step inside
    ``no_sync``, a non-scalar loss, ...)."""


class EngineAPIMissing(EngineError, AttributeError):
    """A DeepSpeed engine API that dscore leaves out (``hasattr`` is False; a call names the docs)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"engine.{name} is a DeepSpeed engine API that dscore does not provide; docs/engine-api.md "
            "('Left out, with the reason') says why and what to use instead"
        )
        self.name = name
