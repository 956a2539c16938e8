"""The standard engine's predicate (its factory is ``dscore.runtime.assembly:build_standard_engine``)."""

from __future__ import annotations

from typing import Any

__all__ = ["handles"]


def handles(model: Any, config: Any) -> bool:
    """True for any ``torch.nn.Module`` (a pipeline model is claimed by the higher-priority pipeline engine)."""
    import torch

    return isinstance(model, torch.nn.Module)
