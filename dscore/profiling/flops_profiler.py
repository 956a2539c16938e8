"""The flops profiler: parameters, MACs, floating-point operations and latency of every module.

Counts follow DeepSpeed 0.19.8's flops profiler (``deepspeed/profiling/flops_profiler/profiler.py``)
exactly, so a model gives the numbers DeepSpeed prints:

* while a profile is active, the ``torch.nn.functional`` functions and ``torch`` / ``torch.Tensor``
  methods in :data:`COUNTED_FUNCTIONS` are replaced by counting wrappers (restored when the profile
  stops); each call adds its flops and MACs to the innermost module whose ``forward`` is running;
* per call: ``linear`` 2·MACs with MACs = ``input.numel() · out_features`` (the bias is not counted);
  ``matmul``/``mm``/``bmm``/``@`` MACs = ``numel(a) · b.shape[-1]``; ``addmm``/``baddbmm`` add
  ``numel(input)``; convolutions ``2 · kernel · in_channels · out_channels/groups · batch · output
  positions`` plus ``out_channels · batch · output positions`` for the bias; activations, softmax and
  pooling ``input.numel()`` flops; ``layer_norm``/``group_norm``/``instance_norm`` ``5 · numel``
  (``4`` without affine weight); ``batch_norm`` ``numel · (2 if affine else 1)`` in eval,
  ``numel · (5 if affine else 4)`` in training; ``scaled_dot_product_attention`` MACs =
  ``numel(q) · L_k + numel(q[..., 0]) · L_k · E_v``; ``embedding`` and ``dropout`` 0; ``add``/``mul``
  (functions and methods, not the ``+``/``*`` operators) the broadcast result's size; RNN modules
  by DeepSpeed's per-gate formulas;
* params of a module are ``sum(p.numel())`` over its parameters (``ds_numel`` for a ZeRO-3 partitioned
  parameter, which DeepSpeed would count as 0 between gathers; expert parameters, tagged by a
  ``group_name`` of ``ep_size_<n>``, are reported separately as DeepSpeed does);
* latency is wall time of each module's forward, with the device synchronized before each clock read.

:class:`FlopsProfiler` is the programmatic API (start / stop / end, totals, :meth:`print_model_profile`
with DeepSpeed's layout); :func:`get_model_profile` profiles one forward of a model. The engine
integration (``flops_profiler`` block of ds_config) is the built-in ``profiling`` plugin.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from dscore.errors import DscoreError

__all__ = [
    "COUNTED_FUNCTIONS",
    "FlopsProfiler",
    "FlopsProfilerError",
    "ModuleProfile",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

log = logging.getLogger("dscore.profiling.flops_profiler")

DEFAULT_PRECISION = 2


class FlopsProfilerError(DscoreError, RuntimeError):
    """The profiler was used out of order (a second profile while one is active, a report before any
    profile) or with arguments it cannot profile."""


# --------------------------------------------------------------------------------------------- formulas
def _prod(dims: Iterable[int]) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def _per_dim(value: Any, length: int) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(int(v) for v in value)
    return (int(value),) * length


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> tuple[int, int]:
    macs = input.numel() * int(weight.shape[0])
    return 2 * macs, macs


def _numel_flops(input: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    return input.numel(), 0


def _zero(*args: Any, **kwargs: Any) -> tuple[int, int]:
    return 0, 0


def _conv(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> tuple[int, int]:
    batch, in_channels, out_channels = int(input.shape[0]), int(input.shape[1]), int(weight.shape[0])
    kernel = [int(k) for k in weight.shape[2:]]
    spatial = [int(s) for s in input.shape[2:]]
    n = len(spatial)
    strides, dilations = _per_dim(stride, n), _per_dim(dilation, n)
    if isinstance(padding, str):
        pads = (0,) * n if padding == "valid" else tuple(d * (k - 1) // 2 for d, k in zip(dilations, kernel))
    else:
        pads = _per_dim(padding, n)
    out_dims = [(spatial[i] + 2 * pads[i] - (dilations[i] * (kernel[i] - 1) + 1)) // strides[i] + 1 for i in range(n)]
    positions = batch * _prod(out_dims)
    macs = _prod(kernel) * in_channels * (out_channels // groups) * positions
    bias_flops = out_channels * positions if bias is not None else 0
    return 2 * macs + bias_flops, macs


def _conv_transpose(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
) -> tuple[int, int]:
    batch, in_channels = int(input.shape[0]), int(input.shape[1])
    per_group = int(weight.shape[1])  # weight is [in, out // groups, *kernel]
    kernel = [int(k) for k in weight.shape[2:]]
    spatial = [int(s) for s in input.shape[2:]]
    n = len(spatial)
    pads, strides, dilations = _per_dim(padding, n), _per_dim(stride, n), _per_dim(dilation, n)
    out_pads = _per_dim(output_padding, n)
    out_dims = [
        (spatial[i] - 1) * strides[i] - 2 * pads[i] + dilations[i] * (kernel[i] - 1) + out_pads[i] + 1 for i in range(n)
    ]
    macs = _prod(kernel) * in_channels * per_group * batch * _prod(spatial)
    bias_flops = per_group * groups * batch * _prod(out_dims) if bias is not None else 0
    return 2 * macs + bias_flops, macs


def _batch_norm(
    input: torch.Tensor,
    running_mean: Any = None,
    running_var: Any = None,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    *args: Any,
    **kwargs: Any,
) -> tuple[int, int]:
    affine = weight is not None
    if training:
        return input.numel() * (5 if affine else 4), 0
    return input.numel() * (2 if affine else 1), 0


def _norm(input: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    """layer_norm(input, shape, weight, bias), group_norm(input, groups, weight, bias): 5 or 4 per element."""
    weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
    return input.numel() * (5 if weight is not None else 4), 0


def _instance_norm(input: torch.Tensor, running_mean: Any = None, running_var: Any = None, weight: Any = None,
                   *args: Any, **kwargs: Any) -> tuple[int, int]:  # fmt: skip
    return input.numel() * (5 if weight is not None else 4), 0


def _upsample(*args: Any, **kwargs: Any) -> tuple[int, int]:
    input = args[0]
    size = kwargs.get("size", args[1] if len(args) > 1 else None)
    if size is not None:
        return (_prod(size) if isinstance(size, (tuple, list)) else int(size)), 0
    scale = kwargs.get("scale_factor", args[2] if len(args) > 2 else None)
    if scale is None:
        raise FlopsProfilerError("interpolate/upsample called with neither size nor scale_factor")
    if isinstance(scale, (tuple, list)):
        flops = input.numel()
        for s in scale:
            flops *= s
        return int(flops), 0
    return int(input.numel() * scale ** (input.ndim - 2)), 0


def _matmul(input: torch.Tensor, other: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    macs = _prod(input.shape) * int(other.shape[-1])
    return 2 * macs, macs


def _addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    macs = _prod(mat1.shape) * int(mat2.shape[-1])
    return 2 * macs + _prod(input.shape), macs


def _elementwise(input: Any, other: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
    a, b = torch.is_tensor(input), torch.is_tensor(other)
    if a and b:
        return _prod(torch.broadcast_shapes(input.shape, other.shape)), 0
    if a:
        return _prod(input.shape), 0
    if b:
        return _prod(other.shape), 0
    return 1, 0


def _einsum_flops(equation: str, shapes: Sequence[Sequence[int]]) -> int:
    """numpy's optimal contraction path cost, as DeepSpeed counts einsum (letters renamed canonically)."""
    import numpy as np

    equation = equation.replace(" ", "")
    order: dict[str, int] = {}
    for ch in equation:
        if ch.isalpha() and ch not in order:
            order[ch] = len(order)
    equation = equation.translate({ord(ch): 97 + i for ch, i in order.items()})
    arrays = [np.zeros(tuple(s)) for s in shapes]
    report = np.einsum_path(equation, *arrays, optimize="optimal")[1]
    for line in report.split("\n"):
        if "optimized flop" in line.lower():
            return int(float(line.split(":")[-1]))
    raise FlopsProfilerError(f"cannot count the flops of einsum {equation!r}")


def _einsum(equation: str, *operands: Any) -> tuple[int, int]:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return _einsum_flops(equation, [o.shape for o in operands]), 0


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    macs = _prod(q.shape) * int(k.shape[-2]) + _prod(q.shape[:-1]) * int(k.shape[-2]) * int(v.shape[-1])
    return 2 * macs, macs


_Formula = Callable[..., tuple[int, int]]

#: ``(owner, attribute, formula)`` of every function counted while a profile is active (DeepSpeed 0.19.8's
#: list). Owners are ``torch.nn.functional``, ``torch`` and ``torch.Tensor``.
COUNTED_FUNCTIONS: tuple[tuple[Any, str, _Formula], ...] = (
    (F, "linear", _linear),
    *((F, f"conv{d}d", _conv) for d in (1, 2, 3)),
    *((F, f"conv_transpose{d}d", _conv_transpose) for d in (1, 2, 3)),
    *((F, name, _numel_flops) for name in ("relu", "prelu", "elu", "leaky_relu", "relu6", "silu", "gelu")),
    (F, "batch_norm", _batch_norm),
    (F, "layer_norm", _norm),
    (F, "instance_norm", _instance_norm),
    (F, "group_norm", _norm),
    *(
        (F, f"{kind}_pool{d}d", _numel_flops)
        for kind in ("avg", "max", "adaptive_avg", "adaptive_max")
        for d in (1, 2, 3)
    ),
    (F, "upsample", _upsample),
    (F, "interpolate", _upsample),
    (F, "softmax", _numel_flops),
    (F, "embedding", _zero),
    (F, "scaled_dot_product_attention", _attention),
    (torch, "matmul", _matmul),
    (torch.Tensor, "matmul", _matmul),
    (torch.Tensor, "__matmul__", _matmul),
    (torch, "mm", _matmul),
    (torch.Tensor, "mm", _matmul),
    (torch, "bmm", _matmul),
    (torch.Tensor, "bmm", _matmul),
    (torch, "addmm", _addmm),
    (torch.Tensor, "addmm", _addmm),
    (torch, "mul", _elementwise),
    (torch.Tensor, "mul", _elementwise),
    (torch, "add", _elementwise),
    (torch.Tensor, "add", _elementwise),
    (torch, "einsum", _einsum),
    (torch, "baddbmm", _addmm),
)


def _rnn_flops(module: nn.Module, w_ih: torch.Tensor, w_hh: torch.Tensor) -> int:
    gates = int(w_ih.shape[0])
    flops = 2 * gates * int(w_ih.shape[1]) - gates + 2 * int(w_hh.shape[0]) * int(w_hh.shape[1]) - gates
    hidden = int(module.hidden_size)  # type: ignore[arg-type]
    if isinstance(module, (nn.RNN, nn.RNNCell)):
        flops += hidden
    elif isinstance(module, (nn.GRU, nn.GRUCell)):
        flops += hidden + 3 * hidden + 3 * hidden
    elif isinstance(module, (nn.LSTM, nn.LSTMCell)):
        flops += 4 * hidden + 3 * hidden + 3 * hidden
    return flops


def _rnn_module_flops(module: nn.Module, inputs: tuple[Any, ...]) -> int:
    x = inputs[0]
    flops = 0
    for layer in range(int(module.num_layers)):  # type: ignore[arg-type]
        flops += _rnn_flops(module, getattr(module, f"weight_ih_l{layer}"), getattr(module, f"weight_hh_l{layer}"))
        if module.bias:
            flops += int(getattr(module, f"bias_ih_l{layer}").shape[0]) + int(
                getattr(module, f"bias_hh_l{layer}").shape[0]
            )
    flops *= int(x.shape[0]) * int(x.shape[1])
    return flops * 2 if module.bidirectional else flops


def _rnn_cell_flops(module: nn.Module, inputs: tuple[Any, ...]) -> int:
    x = inputs[0]
    cell: Any = module
    flops = _rnn_flops(module, cell.weight_ih, cell.weight_hh)
    if cell.bias:
        flops += int(cell.bias_ih.shape[0]) + int(cell.bias_hh.shape[0])
    return flops * int(x.shape[0])


#: Modules counted whole from their weights (their functionals are not patched: RNN kernels).
_MODULE_FORMULAS: dict[type, Callable[[nn.Module, tuple[Any, ...]], int]] = {
    nn.RNN: _rnn_module_flops,
    nn.GRU: _rnn_module_flops,
    nn.LSTM: _rnn_module_flops,
    nn.RNNCell: _rnn_cell_flops,
    nn.LSTMCell: _rnn_cell_flops,
    nn.GRUCell: _rnn_cell_flops,
}

# One profile patches torch at a time (the replaced functions are process-wide).
_PATCH_LOCK = threading.Lock()
_PATCH_OWNER: FlopsProfiler | None = None


# --------------------------------------------------------------------------------------------- strings
def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` scaled to T/G/M/K/(none)/m/u with ``precision`` decimals, e.g. ``197.63 K`` (DeepSpeed's format)."""
    scales = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "m": 1e-3, "u": 1e-6}
    if units is None:
        for prefix, magnitude in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
            if num >= magnitude:
                units = prefix
                break
        else:
            if num >= 1 or num == 0:
                units, magnitude = "", 1.0
            elif num >= 1e-3:
                units, magnitude = "m", 1e-3
            else:
                units, magnitude = "u", 1e-6
    else:
        magnitude = scales.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``98.3 KMACs``."""
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``1.2 GFLOPS`` (per second)."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``12.45 K`` (billions as ``B``)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``1.5 ms``."""
    return f"{number_to_string(seconds, units, precision)}s"


# --------------------------------------------------------------------------------------------- profiler
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
            formula = _MODULE_FORMULAS.get(type(module))
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
                return _einsum_flops(equation, [o.shape for o in operands]), 0

            self._originals.append((einops, "einsum", original))
            einops.einsum = self._counting(original, einops_formula)  # type: ignore[attr-defined]
        self.func_patched = True

    def _counting(self, original: Callable[..., Any], formula: _Formula) -> Callable[..., Any]:
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
            _write(sys.stdout, text)

    def profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                     detailed: bool = True) -> str:  # fmt: skip
        """The report :meth:`print_model_profile` writes, as a string."""
        self._require()
        total_flops = int(self.get_total_flops())
        total_macs = int(self.get_total_macs())
        total_duration = float(self.get_total_duration())
        total_params = int(self.get_total_params())
        self.flops, self.macs, self.params = total_flops, total_macs, total_params
        engine = self.ds_engine
        mp = int(getattr(engine, "mp_world_size", 1) or 1) if engine is not None else 1
        root = self._stats[self.model]
        model_nonexpert = root.params * mp if engine is not None else 0
        model_expert = root.model_expert_params if engine is not None else 0
        lines: list[str] = []
        out = lines.append
        fmt = "{:<70}  {:<8}"
        out("\n-------------------------- DeepSpeed Flops Profiler --------------------------")
        out(f"Profile Summary at step {profile_step}:")
        out(
            "Notations:\n"
            "data parallel size (dp_size), model parallel size(mp_size),\n"
            "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
            "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
            "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
            "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
        )
        micro_batch = 0
        if engine is not None:
            micro_batch = int(engine.train_micro_batch_size_per_gpu())
            out(fmt.format("world size: ", engine.world_size))
            out(fmt.format("data parallel size: ", engine.dp_world_size))
            out(fmt.format("model parallel size: ", mp))
            out(fmt.format("batch size per GPU: ", micro_batch))
            if model_expert:
                out(fmt.format("expert tensor parallelism enabled: ", False))
        out(fmt.format("params per GPU: ", params_to_string(total_params)))
        if model_expert > 0:
            out(fmt.format("params of model: ", params_to_string(model_nonexpert + model_expert)))
            out(fmt.format("   non-expert params of model: ", params_to_string(model_nonexpert)))
            out(fmt.format("   expert params of model: ", params_to_string(model_expert)))
        else:
            out(fmt.format("params of model = params per GPU * mp_size: ", params_to_string(model_nonexpert)))
        out(fmt.format("fwd MACs per GPU: ", macs_to_string(total_macs)))
        out(fmt.format("fwd flops per GPU: ", number_to_string(total_flops)))
        out(fmt.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total_flops * mp)))
        phases = self.engine_latencies
        fwd = phases["forward"] if phases else total_duration
        out(fmt.format("fwd latency: ", duration_to_string(fwd)))
        out(
            fmt.format(
                "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(_ratio(total_flops, fwd))
            )
        )
        if phases:
            factor = 2 + self.recompute_fwd_factor
            bwd, step = phases["backward"], phases["step"]
            out(fmt.format("bwd latency: ", duration_to_string(bwd)))
            out(fmt.format(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                           flops_to_string(_ratio(factor * total_flops, bwd))))  # fmt: skip
            out(fmt.format(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                           flops_to_string(_ratio((factor + 1) * total_flops, fwd + bwd))))  # fmt: skip
            out(fmt.format("step latency: ", duration_to_string(step)))
            it = fwd + bwd + step
            out(fmt.format("iter latency: ", duration_to_string(it)))
            out(fmt.format(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                           flops_to_string(_ratio((factor + 1) * total_flops, it))))  # fmt: skip
            samples = micro_batch * int(engine.world_size) if engine is not None else 0
            out(fmt.format("samples/second: ", round(_ratio(samples, it), DEFAULT_PRECISION)))
        out("\n----------------------------- Aggregated Profile per GPU -----------------------------")
        lines.extend(self._aggregated_lines(module_depth, top_modules))
        if detailed:
            out("\n------------------------------ Detailed Profile per GPU ------------------------------")
            out(
                "Each module profile is listed after its name in the following order: \nparams, percentage of "
                "total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, "
                "fwd FLOPS"
            )
            out(
                "\nNote: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. "
                "CrossEntropyLoss). They are not counted as submodules, thus not to be printed out. However they "
                "make up the difference between a parent's MACs (or latency) and the sum of its submodules'.\n"
                "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using "
                "that could be larger than the maximum system throughput.\n3. The fwd latency listed in the top "
                "module's profile is directly captured at the module forward function in PyTorch, thus it's less "
                "than the fwd latency shown above which is captured in DeepSpeed.\n"
            )
            out(self._annotated_tree(total_params, total_macs, total_duration))
        out("------------------------------------------------------------------------------")
        return "\n".join(lines) + "\n"

    def _annotated_tree(self, total_params: int, total_macs: int, total_duration: float) -> str:
        """``repr(model)`` with each module's numbers before its own ``extra_repr``."""

        def pct(part: float, whole: float) -> float:
            return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0

        replaced: list[nn.Module] = []
        try:
            for module in self.model.modules():
                original = module.extra_repr
                params = self.module_params(module)
                macs = self.module_macs(module)
                duration = self.module_duration(module)
                flops = self.module_flops(module)
                items = [
                    f"{params_to_string(params)} = {pct(params, total_params):g}% Params",
                    f"{macs_to_string(macs)} = {pct(macs, total_macs):g}% MACs",
                    f"{duration_to_string(duration)} = {pct(duration, total_duration):g}% latency",
                    flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0),
                ]
                own = original()
                if own:
                    items.append(own)
                text = ", ".join(items)
                module.extra_repr = _constant(text)  # type: ignore[method-assign]
                replaced.append(module)
            return repr(self.model)
        finally:
            for module in replaced:
                module.__dict__.pop("extra_repr", None)

    def _aggregated_lines(self, module_depth: int, top_modules: int) -> list[str]:
        info: dict[int, dict[str, list[float]]] = {}

        def walk(module: nn.Module, depth: int) -> None:
            row = info.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
            row[0] += self.module_macs(module)
            row[1] += self.module_params(module)
            row[2] += self.module_duration(module)
            for child in module.children():
                walk(child, depth + 1)

        walk(self.model, 0)
        # DeepSpeed lists depths 0 .. len-2 for -1 (the innermost level is left out), and so do we.
        depth = len(info) - 1 if module_depth == -1 else module_depth
        lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
        for d in range(depth):
            rows = info.get(d, {})
            n = min(top_modules, len(rows))

            def top(index: int, to_string: Callable[[float], str], rows: dict[str, list[float]] = rows,
                    n: int = n) -> dict[str, str]:  # fmt: skip
                ranked = sorted(rows.items(), key=lambda kv: kv[1][index], reverse=True)[:n]
                return {k: to_string(v[index]) for k, v in ranked}

            lines.append(f"depth {d}:")
            lines.append(f"    params      - {top(1, params_to_string)}")
            lines.append(f"    MACs        - {top(0, macs_to_string)}")
            lines.append(f"    fwd latency - {top(2, duration_to_string)}")
        return lines


def _constant(text: str) -> Callable[[], str]:
    return lambda: text


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _write(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()


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
