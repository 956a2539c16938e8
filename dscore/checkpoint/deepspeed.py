"""``dscore.checkpoint.deepspeed``: DeepSpeed checkpoint tools, provided by the ``checkpoint_layout:deepspeed`` unit.

Reading DeepSpeed 0.19.8 save directories safely (no pickled code runs: :func:`safe_load` with the
allow-list :data:`ALLOWED_DEEPSPEED_GLOBALS`), at any world size and ZeRO stage: :class:`DeepSpeedCheckpoint`
(validated description of every shard), :func:`import_checkpoint` (``dscore checkpoint import``),
:func:`export_fp32` (``dscore checkpoint export DS_DIR --fp32 OUT``), :func:`get_fp32_state_dict_from_deepspeed`,
:func:`is_deepspeed_checkpoint`, :func:`looks_like_deepspeed_tag_dir`, :func:`resolve_deepspeed_tag`,
:func:`read_for_engine`. Each name resolves on first access through the registry to the exports module of
the ``deepspeed`` checkpoint layout; with that unit disabled the import raises the registry's error naming
``checkpoint_layout:deepspeed`` and how to re-enable it.
"""

from __future__ import annotations

from dscore.exports import thin_getattr

# the names of __all__ resolve through __getattr__ (registry), so they are not defined here
# ruff: noqa: F822

__all__ = [
    "ALLOWED_DEEPSPEED_GLOBALS",
    "DeepSpeedCheckpoint",
    "export_fp32",
    "get_fp32_state_dict_from_deepspeed",
    "import_checkpoint",
    "is_deepspeed_checkpoint",
    "looks_like_deepspeed_tag_dir",
    "read_for_engine",
    "resolve_deepspeed_tag",
    "safe_load",
]

__getattr__ = thin_getattr(__name__, "checkpoint_layout", "deepspeed", __all__)
