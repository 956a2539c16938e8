"""``deepspeed.runtime.activation_checkpointing``: activation checkpointing on :mod:`dscore.checkpointing`
(see :mod:`.checkpointing`)."""
