"""Built-in profiling plugin: the flops profiler and the ``flops_profiler`` block driving it in a run.

* :mod:`~dscore_plugins.profiling.formulas`: DeepSpeed 0.19.8's counting rules (flops/MACs per call);
* :mod:`~dscore_plugins.profiling.profiler`: :class:`FlopsProfiler` (hooks, patches, per-module counts);
* :mod:`~dscore_plugins.profiling.model_profile`: ``get_model_profile`` (one profiled forward);
* :mod:`~dscore_plugins.profiling.report`: the printed report and DeepSpeed's number formats;
* :mod:`~dscore_plugins.profiling.exports`: the names ``dscore.profiling.flops_profiler`` re-exports;
* :mod:`~dscore_plugins.profiling.engine_profiler`: the engine integration (``flops_profiler`` block).
"""
