"""``deepspeed.checkpoint.ds_to_universal``: DeepSpeed 0.19.8's universal-checkpoint tooling, not provided by dscore.

Every name imports (``from deepspeed.checkpoint.ds_to_universal import main``) and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: dscore has no universal-checkpoint format, because a
DeepSpeed checkpoint (ZeRO stages 0-3, any data-parallel size) loads directly into a dscore engine of another world
size or stage (``engine.load_checkpoint``); ``dscore checkpoint export DIR --fp32 OUT`` consolidates one.
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__,
    "dscore has no universal-checkpoint format; a DeepSpeed checkpoint loads directly at another world size or ZeRO "
    "stage (engine.load_checkpoint), and 'dscore checkpoint export DIR --fp32 OUT' consolidates one",
)
