"""The built-in ``mps`` accelerator plugin (manifest in ``plugin.py``, implementation in ``accelerator.py``)."""
