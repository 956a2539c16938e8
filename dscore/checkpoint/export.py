"""``dscore.checkpoint.export``: the export names of :mod:`dscore.persistence.export` at their historical path."""

from __future__ import annotations

from dscore.persistence.export import (
    DTYPES,
    convert_checkpoint,
    describe_checkpoints,
    get_fp32_state_dict_from_checkpoint,
    import_checkpoint,
    save_16bit_model,
)

__all__ = [
    "DTYPES",
    "convert_checkpoint",
    "describe_checkpoints",
    "get_fp32_state_dict_from_checkpoint",
    "import_checkpoint",
    "save_16bit_model",
]
