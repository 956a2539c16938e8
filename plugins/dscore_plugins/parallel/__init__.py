"""The built-in ``parallel`` plugin: the model transforms AutoTP, AutoEP, Ulysses and activation checkpointing
(``model_transform`` specs) and the ds_config sections they own (``tensor_parallel``, ``expert_parallel``,
``activation_checkpointing``). The manifest is :mod:`dscore_plugins.parallel.plugin`.
"""
