"""The flops profiler: parameters, MACs, floating-point operations and latency of every module.

:class:`FlopsProfiler` is the programmatic API (start / stop / end, per-module counts and totals,
:meth:`~FlopsProfiler.print_model_profile` with DeepSpeed's layout); ``get_model_profile``
(:mod:`dscore_plugins.profiling.model_profile`) profiles one forward of a model. While a profile is active,
the counted ``torch`` functions are patched process-wide (one profile at a time) and each call's count, by
the rules of :mod:`dscore_plugins.profiling.formulas`, goes to the innermost module whose ``forward`` is
running. The report is :mod:`dscore_plugins.profiling.report`.

* params of a module are ``sum(p.numel())`` over its parameters (``ds_numel`` for a ZeRO-3 partitioned
  parameter, which DeepSpeed would count as 0 between gathers; expert parameters, tagged by a
  ``group_name`` of ``ep_size_<n>``, are reported separately as DeepSpeed does);
* latency is wall time of each module's forward, with the device synchronized before each clock read.

User code imports these names from ``dscore.profiling.flops_profiler`` (or DeepSpeed's
``deepspeed.profiling.flops_profiler``): thin names over this plugin's exports. The engine integration
(``flops_profiler`` block of ds_config) is :mod:`dscore_plugins.profiling.engine_profiler`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dscore_plugins.profiling.formulas import (
    COUNTED_FUNCTIONS,
    MODULE_FORMULAS,
    FlopsProfilerError,
    Formula,
    einsum_flops,
)
from dscore_plugins.profiling.report import (
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    profile_text,
    write_text,
)

__all__ = ["FlopsProfiler", "ModuleProfile"]

log = logging.getLogger("dscore.profiling.flops_profiler")

# One profile patches torch at a time (the replaced functions are process-wide).
_PATCH_LOCK = threading.Lock()
_PATCH_OWNER: FlopsProfiler | None = None


@dataclass
class ModuleProfile:
    """What one module measured in the profiled forward (its own calls; children are separate entries).

    Attributes:
        flops / macs: counted by calls made directly in this module's forward (not its children's).
        params: non-expert parameters of the module and its children (elements).
        expert_params: expert parameters (``group_name`` ``ep_size_<n>``) of the module and children.
        model_expert_params: expert parameters times their expert-parallel size (the whole model's).
        duration: seconds spent in the module's forward (summed over calls).
    """

    flops: int = 0
    macs: int = 0
    params: int = 0
    expert_params: int = 0
    model_expert_params: int = 0
    duration: float = 0.0
    started: list[float] = field(default_factory=list)


def _default_synchronize(model: nn.Module) -> Callable[[], None]:
    """Synchronize the device the model's first parameter lives on (nothing for the host)."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return lambda: None
    if device.type == "cpu":
        return lambda: None
    module = torch.get_device_module(device.type)
    sync = getattr(module, "synchronize", None)
    return sync if callable(sync) else (lambda: None)


class FlopsProfiler:
    """Measure params, MACs, flops and forward latency of every module of ``model``.

    Usage (the same calls as DeepSpeed's ``FlopsProfiler``)::

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch)
        prof.print_model_profile(profile_step=step)   # or get_total_flops() / get_total_macs() / ...
        prof.end_profile()

    Args:
        model: the module to profile.
        ds_engine: the engine training it (adds world size, batch size and the engine's
            forward/backward/step latencies to the report), or None.
        recompute_fwd_factor: extra forward passes recomputed in backward (activation checkpointing),
            used for the backward flops estimate ``(2 + factor) · fwd flops``.
        synchronize: called before each clock read; default: the device of the model's parameters.

    Raises:
        FlopsProfilerError: ``start_profile`` while another profile is active in this process.
    """

    def __init__(
        self,
        model: nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise FlopsProfilerError(f"FlopsProfiler needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self.func_patched = False
        self._sync = synchronize or _default_synchronize(model)
        self._stats: dict[nn.Module, ModuleProfile] = {}
        self._frames: list[list[tuple[int, int]]] = []
        self._handles: list[Any] = []
        self._originals: list[tuple[Any, str, Any]] = []
        #: phase latencies (seconds) the engine integration fills in: forward, backward, step
        self.engine_latencies: dict[str, float] | None = None
        self.flops = self.macs = self.params = 0

    # ----------------------------------------------------------------- lifecycle
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset the counts, install the module hooks and patch the counted functions.

        Args:
            ignore_list: module types whose forward is not measured (their calls count toward the parent).
        """
        global _PATCH_OWNER
        with _PATCH_LOCK:
            if _PATCH_OWNER is not None and _PATCH_OWNER is not self:
                raise FlopsProfilerError(
                    "another FlopsProfiler is active in this process (torch functions are patched "
                    "process-wide); call end_profile() on it first"
                )
            _PATCH_OWNER = self
        log.info("Flops profiler started")
        self.reset_profile()
        self._remove_hooks()
        self._patch()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if type(module) in ignored:
                continue
            formula = MODULE_FORMULAS.get(type(module))
            if formula is not None:
                self._handles.append(module.register_forward_hook(self._module_formula_hook(formula)))
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook))
        self.started = True

    def stop_profile(self) -> None:
        """Restore the patched functions and remove the hooks; the counts stay readable."""
        self._unpatch()
        self._remove_hooks()

    def reset_profile(self) -> None:
        """Zero every module's counts (parameter counts are taken now)."""
        self._stats = {}
        self._frames = []
        for module in self.model.modules():
            stats = ModuleProfile()
            for p in module.parameters():
                group = getattr(p, "group_name", "")
                ep = 0
                if isinstance(group, str) and group.startswith("ep_size_"):
                    try:
                        ep = int(group[len("ep_size_") :])
                    except ValueError:
                        ep = 0
                # ZeRO-3 leaves a partitioned parameter empty between gathers: its full size is ds_numel
                numel = int(getattr(p, "ds_numel", p.numel()))
                if ep:
                    stats.expert_params += numel
                    stats.model_expert_params += numel * ep
                else:
                    stats.params += numel
            self._stats[module] = stats

    def end_profile(self) -> None:
        """Stop profiling and forget the counts."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        self._stats = {}
        log.info("Flops profiler finished")

    # ----------------------------------------------------------------- hooks and patches
    def _pre_hook(self, module: nn.Module, inputs: Any) -> None:
        self._frames.append([])
        self._sync()
        self._stats[module].started.append(time.time())

    def _post_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        stats = self._stats[module]
        if self._frames:
            frame = self._frames.pop()
            stats.flops += sum(f for f, _ in frame)
            stats.macs += sum(m for _, m in frame)
        self._sync()
        if stats.started:
            stats.duration += time.time() - stats.started.pop()

    def _module_formula_hook(self, formula: Callable[[nn.Module, tuple[Any, ...]], int]) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            self._stats[module].flops += int(formula(module, inputs))

        return hook

    def _patch(self) -> None:
        if self.func_patched:
            return
        for owner, name, formula in COUNTED_FUNCTIONS:
            original = getattr(owner, name, None)
            if original is None:
                continue
            self._originals.append((owner, name, original))
            setattr(owner, name, self._counting(original, formula))
        einops = sys.modules.get("einops")
        if einops is not None and hasattr(einops, "einsum"):
            original = einops.einsum

            def einops_formula(*args: Any) -> tuple[int, int]:
                *operands, equation = args
                return einsum_flops(equation, [o.shape for o in operands]), 0

            self._originals.append((einops, "einsum", original))
            einops.einsum = self._counting(original, einops_formula)  # type: ignore[attr-defined]
        self.func_patched = True

    def _counting(self, original: Callable[..., Any], formula: Formula) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            stack = self._frames
            if stack:
                flops, macs = formula(*args, **kwargs)
                stack[-1].append((int(flops), int(macs)))
            return original(*args, **kwargs)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted.__doc__ = getattr(original, "__doc__", None)
        return counted

    def _unpatch(self) -> None:
        global _PATCH_OWNER
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []
        self.func_patched = False
        with _PATCH_LOCK:
            if _PATCH_OWNER is self:
                _PATCH_OWNER = None

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ----------------------------------------------------------------- totals
    def _require(self) -> None:
        if not self._stats:
            raise FlopsProfilerError("no profile: call start_profile() and run a forward pass first")

    def module_profile(self, module: nn.Module) -> ModuleProfile:
        """The :class:`ModuleProfile` of ``module`` (its own calls only)."""
        self._require()
        return self._stats[module]

    def module_flops(self, module: nn.Module) -> int:
        """Flops of ``module``'s forward including its children's (each module object counted once)."""
        self._require()
        return sum(self._stats[m].flops for m in module.modules())

    def module_macs(self, module: nn.Module) -> int:
        """MACs of ``module``'s forward including its children's."""
        self._require()
        return sum(self._stats[m].macs for m in module.modules())

    def module_duration(self, module: nn.Module) -> float:
        """Seconds in ``module``'s forward; a container never called itself (``ModuleList``) sums its children."""
        self._require()
        duration = self._stats[module].duration
        if duration == 0:
            duration = sum(self.module_duration(child) for child in module.children())
        return duration

    def module_params(self, module: nn.Module) -> int:
        """Parameters of ``module`` held by this rank (expert and non-expert)."""
        self._require()
        stats = self._stats[module]
        return stats.params + stats.expert_params

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Floating-point operations of the profiled forward."""
        total = self.module_flops(self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulate operations of the profiled forward."""
        total = self.module_macs(self.model)
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds of the profiled forward, measured at the model's own forward."""
        total = self.module_duration(self.model)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters stored on this rank."""
        total = self.module_params(self.model)
        return params_to_string(total) if as_string else total

    # ----------------------------------------------------------------- report
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Write the profile in DeepSpeed's layout: summary, aggregated profile, detailed module tree.

        Args:
            profile_step: the step reported in the header.
            module_depth: deepest level of the aggregated profile (-1: all levels).
            top_modules: modules listed per level of the aggregated profile.
            detailed: append the module tree with each module's numbers.
            output_file: write to this file (its folder is created) instead of standard output.

        Raises:
            FlopsProfilerError: no profile was taken.
        """
        if not self.started:
            return
        text = self.profile_text(profile_step, module_depth, top_modules, detailed)
        if output_file:
            folder = os.path.dirname(os.path.abspath(output_file))
            os.makedirs(folder, exist_ok=True)
            with open(output_file, "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            write_text(sys.stdout, text)


    def profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                     detailed: bool = True) -> str:  # fmt: skip
        """The report :meth:`print_model_profile` writes, as a string
        (:func:`dscore_plugins.profiling.report.profile_text`); also sets the totals ``flops``, ``macs`` and
        ``params`` (DeepSpeed's attributes).

        Raises:
            FlopsProfilerError: no profile was taken.
        """
        self._require()
        self.flops = int(self.get_total_flops())
        self.macs = int(self.get_total_macs())
        self.params = int(self.get_total_params())
        return profile_text(self, profile_step, module_depth, top_modules, detailed)

