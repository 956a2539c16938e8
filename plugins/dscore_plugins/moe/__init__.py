"""Built-in MoE plugin: wires :class:`dscore.moe.layer.MoE` layers of a model into the engine."""
