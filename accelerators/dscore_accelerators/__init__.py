"""dscore's built-in accelerator plugins (cpu, cuda, xpu, hpu, npu, mps), one sub-package each.

Each sub-package holds ``plugin.py`` (the entry-point manifest: an ``AcceleratorSpec`` and a cheap
probe, torch-free at import) and ``accelerator.py`` (the implementation).
"""
