"""The built-in ``hpu`` accelerator plugin (manifest in ``plugin.py``, implementation in ``accelerator.py``)."""
