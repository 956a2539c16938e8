"""Built-in plugin ``checkpoint``: the checkpoint layouts (``checkpoint_layout`` units).

* ``dscore``: the native, pickle-free layout (its code is the core's :mod:`dscore.persistence.native`, the
  reference a third-party layout is written against);
* ``deepspeed``: DeepSpeed 0.19.8's files, read without running pickled code at any world size and ZeRO
  stage, written for tools that read them (:mod:`dscore_plugins.checkpoint_ds.layout`); its tools are
  the names of :mod:`dscore.checkpoint.deepspeed` (exports module :mod:`dscore_plugins.checkpoint_ds.api`).

``DSCORE_DISABLE_PLUGINS=checkpoint_layout:deepspeed`` turns the DeepSpeed layout off: saving in it and
loading a DeepSpeed checkpoint are refused naming the unit.
"""
