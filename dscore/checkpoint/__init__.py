"""The user-facing checkpoint names at their historical path; the machinery is :mod:`dscore.persistence`.

``from dscore.checkpoint import get_fp32_state_dict_from_checkpoint`` (what the ``deepspeed`` compatibility
distribution's ``zero_to_fp32`` uses), ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model``
(what the engine's methods call), ``convert_checkpoint``, ``describe_checkpoints``, ``list_tags``,
``read_latest``: each is the object of the same name in :mod:`dscore.persistence` (see there for the layout,
the guarantees and the errors). :mod:`dscore.checkpoint.deepspeed` names the DeepSpeed layout's tools,
resolved through the registry (unit ``checkpoint_layout:deepspeed``).
"""

from __future__ import annotations

from dscore.persistence import (
    CheckpointEngine,
    convert_checkpoint,
    describe_checkpoints,
    get_fp32_state_dict_from_checkpoint,
    import_checkpoint,
    list_tags,
    load_checkpoint,
    read_latest,
    save_16bit_model,
    save_checkpoint,
)

__all__ = [
    "CheckpointEngine",
    "convert_checkpoint",
    "describe_checkpoints",
    "get_fp32_state_dict_from_checkpoint",
    "import_checkpoint",
    "list_tags",
    "load_checkpoint",
    "read_latest",
    "save_16bit_model",
    "save_checkpoint",
]
