"""ZeRO++ (hpZ, qwZ, qgZ): options of ZeRO stage 3, registered by :mod:`dscore_plugins.zeropp.plugin`."""
