"""``deepspeed.profiling`` (import ``deepspeed.profiling.flops_profiler``)."""
