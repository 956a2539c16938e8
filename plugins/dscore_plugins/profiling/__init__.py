"""Built-in profiling plugin: the ``flops_profiler`` block (engine integration of
:mod:`dscore.profiling.flops_profiler`)."""
