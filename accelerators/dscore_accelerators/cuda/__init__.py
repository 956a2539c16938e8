"""The built-in ``cuda`` accelerator plugin (manifest in ``plugin.py``, implementation in ``accelerator.py``)."""
