"""The built-in ``xpu`` accelerator plugin (manifest in ``plugin.py``, implementation in ``accelerator.py``)."""
