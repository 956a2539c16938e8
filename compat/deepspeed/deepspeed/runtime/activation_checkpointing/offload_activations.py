"""``deepspeed.runtime.activation_checkpointing.offload_activations``: DeepSpeed's hidden-state offloading
context managers.

dscore does not provide them; each name imports and raises :class:`deepspeed._not_provided.NotProvidedError`
when used: dscore offloads checkpointed activations with ``checkpoint_in_cpu`` (the activation_checkpointing
config block, or ``deepspeed.checkpointing.configure(checkpoint_in_cpu=True)``).
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "dscore has no hidden-state offloading context manager; use checkpoint_in_cpu in the "
    "activation_checkpointing config block (or deepspeed.checkpointing.configure(checkpoint_in_cpu=True))"
)
