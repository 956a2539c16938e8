"""Built-in op builders (cpu_adam, cpu_adagrad, cpu_lion, fused_adam, fused_lamb, fused_lion) and the
optimizer classes that run them. The kernels live in ``csrc/`` (package data ``dscore_plugins/ops/csrc``).
"""
