"""ZeRO stages 0-3 (stage 0 = plain data parallelism), registered by :mod:`dscore_plugins.zero.plugin`."""
