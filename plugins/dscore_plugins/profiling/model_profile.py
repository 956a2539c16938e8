"""``get_model_profile``: params, MACs and flops of one forward (or ``generate``) of a model.

DeepSpeed 0.19.8's one-call API over :class:`~dscore_plugins.profiling.profiler.FlopsProfiler`: the model
is put in eval mode, called ``warm_up`` times unprofiled, then once under the profiler, whose report is
printed (or written to ``output_file``) in DeepSpeed's layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dscore_plugins.profiling.formulas import FlopsProfilerError
from dscore_plugins.profiling.profiler import FlopsProfiler
from dscore_plugins.profiling.report import macs_to_string, number_to_string, params_to_string

__all__ = ["get_model_profile"]

log = logging.getLogger("dscore.profiling.flops_profiler")


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """Profile one forward (or ``generate``) of ``model`` after ``warm_up`` unprofiled calls.

    Args:
        model: the module (put in eval mode, as DeepSpeed does).
        input_shape: build one input of this shape (``new_empty`` in the dtype and device of the model's
            first parameter) as the only positional argument; else ``args``/``kwargs`` are passed.
        print_profile / detailed / module_depth / top_modules / output_file: as
            :meth:`FlopsProfiler.print_model_profile`.
        warm_up: unprofiled calls first.
        as_string: return strings (``"197.63 K"``, ``"98.3 KMACs"``, ``"12.45 K"``) instead of ints.
        ignore_modules: module types not measured.
        mode: ``"forward"`` (``model(...)``) or ``"generate"`` (``model.generate(...)``).

    Returns:
        ``(flops, macs, params)``.

    Raises:
        FlopsProfilerError: no input given, a malformed ``input_shape``, or an unknown ``mode``.
    """
    if not isinstance(model, nn.Module):
        raise FlopsProfilerError(f"get_model_profile needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise FlopsProfilerError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    call_args = list(args or [])
    call_kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise FlopsProfilerError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        try:
            first = next(model.parameters())
            x = torch.empty(input_shape, dtype=first.dtype, device=first.device)
        except StopIteration:
            x = torch.empty(input_shape, device=torch.device("cpu"))
        call_args = [x]
    if not call_args and not call_kwargs:
        raise FlopsProfilerError("get_model_profile needs input_shape, args or kwargs")
    prof = FlopsProfiler(model)
    model.eval()
    target: Any = model
    run: Callable[..., Any] = target if mode == "forward" else target.generate
    log.info("Flops profiler warming up (%d calls)", warm_up)
    for _ in range(warm_up):
        run(*call_args, **call_kwargs)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        run(*call_args, **call_kwargs)
        prof.stop_profile()
        flops, macs, params = int(prof.get_total_flops()), int(prof.get_total_macs()), int(prof.get_total_params())
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)  # fmt: skip
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
