"""Activation checkpointing: ``dscore.checkpointing.checkpoint(fn, *args)`` (DeepSpeed's ``deepspeed.checkpointing``).

``checkpoint(fn, *args)`` runs ``fn(*args)`` saving only its inputs and recomputes it in backward with the
forward's RNG states; ``configure`` (DeepSpeed's argument names, or the ``activation_checkpointing`` block
``dscore.initialize`` applies), ``settings``, ``is_configured``, ``reset`` and ``set_num_layers`` manage the
process-wide settings. The machinery is the ``activation_checkpointing`` model transform of the built-in
``parallel`` plugin; these names resolve through the registry on first access
(:func:`dscore.exports.thin_getattr`): inside ``dscore.initialize`` the runtime's, otherwise the installed
plugins' (so model code can call ``checkpoint`` with no runtime). Importing this module imports no torch.
"""

from __future__ import annotations

from typing import Any

from dscore.exports import thin_getattr

__all__ = [
    "CheckpointSettings",
    "CheckpointingError",
    "checkpoint",
    "configure",
    "is_configured",
    "reset",
    "set_num_layers",
    "settings",
]

_resolve = thin_getattr(__name__, "model_transform", "activation_checkpointing", [*__all__, "_reset_for_tests"])


def __getattr__(name: str) -> Any:
    """Resolve one of ``__all__`` through the registry on first access (then a plain module attribute)."""
    return _resolve(name)
