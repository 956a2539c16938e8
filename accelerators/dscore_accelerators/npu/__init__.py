"""The built-in ``npu`` accelerator plugin (manifest in ``plugin.py``, implementation in ``accelerator.py``)."""
