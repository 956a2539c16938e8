"""The pipeline engine's machinery (the core keeps the model definition, :mod:`dscore.pipe`).

* :mod:`~dscore_plugins.engine.pipe.schedule`: the 1F1B and inference schedules (pure Python);
* :mod:`~dscore_plugins.engine.pipe.p2p`: activation and gradient transfer between neighbouring stages;
* :mod:`~dscore_plugins.engine.pipe.checkpoint`: the per-layer checkpoint layout, its atomic save and
  load rules, and ``layer_state_dicts`` / ``load_into_layers`` (the ``exports`` module of the ``engine``
  unit ``pipeline``: ``dscore.pipe.load_into_layers`` resolves to it);
* :mod:`~dscore_plugins.engine.pipe.engine_io`: the engine's ``save_checkpoint`` / ``load_checkpoint``.

Nothing is imported here.
"""
