"""The built-in ``cpu`` accelerator plugin (manifest in ``plugin.py``, implementation in ``accelerator.py``)."""
