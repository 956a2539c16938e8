"""DeepSpeed 0.19.8's counting rules: the flops and MACs of each counted call, and of RNN modules.

Counts follow DeepSpeed 0.19.8's flops profiler (``deepspeed/profiling/flops_profiler/profiler.py``)
exactly, so a model gives the numbers DeepSpeed prints:

* while a profile is active, the ``torch.nn.functional`` functions and ``torch`` / ``torch.Tensor``
  methods in :data:`COUNTED_FUNCTIONS` are replaced by counting wrappers (restored when the profile
  stops; :mod:`dscore_plugins.profiling.profiler`); each call adds its flops and MACs to the innermost
  module whose ``forward`` is running;
* per call: ``linear`` 2·MACs with MACs = ``input.numel() · out_features`` (the bias is not counted);
  ``matmul``/``mm``/``bmm``/``@`` MACs = ``numel(a) · b.shape[-1]``; ``addmm``/``baddbmm`` add
  ``numel(input)``; convolutions ``2 · kernel · in_channels · out_channels/groups · batch · output
  positions`` plus ``out_channels · batch · output positions`` for the bias; activations, softmax and
  pooling ``input.numel()`` flops; ``layer_norm``/``group_norm``/``instance_norm`` ``5 · numel``
  (``4`` without affine weight); ``batch_norm`` ``numel · (2 if affine else 1)`` in eval,
  ``numel · (5 if affine else 4)`` in training; ``scaled_dot_product_attention`` MACs =
  ``numel(q) · L_k + numel(q[..., 0]) · L_k · E_v``; ``embedding`` and ``dropout`` 0; ``add``/``mul``
  (functions and methods, not the ``+``/``*`` operators) the broadcast result's size; ``einsum`` numpy's
  optimal contraction cost (:func:`einsum_flops`); RNN modules by DeepSpeed's per-gate formulas
  (:data:`MODULE_FORMULAS`, counted whole from their weights).

Every rule takes the counted function's own arguments (tensors; only their shapes are read) and returns
``(flops, macs)`` as Python ints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscore.errors import DscoreError

__all__ = ["COUNTED_FUNCTIONS", "MODULE_FORMULAS", "FlopsProfilerError", "Formula", "einsum_flops"]


class FlopsProfilerError(DscoreError, RuntimeError):
    """The profiler was used out of order (a second profile while one is active, a report before any
    profile) or with arguments it cannot profile (an ``interpolate`` without size, an einsum numpy
    cannot cost)."""


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


def einsum_flops(equation: str, shapes: Sequence[Sequence[int]]) -> int:
    """numpy's optimal contraction path cost, as DeepSpeed counts einsum (letters renamed canonically).

    Raises:
        FlopsProfilerError: numpy is not installed (dscore does not depend on it; the ``profiling`` extra
            installs it), or numpy's path report has no flop count.
    """
    try:
        import numpy as np
    except ImportError as exc:
        raise FlopsProfilerError(
            f"the flops profiler counts torch.einsum ({equation!r}) with numpy's einsum_path, and numpy cannot "
            f"be imported ({exc}); install it: pip install 'dscore[profiling]' (or pip install numpy)"
        ) from exc

    equation = equation.replace(" ", "")
    order: dict[str, int] = {}
    for ch in equation:
        if ch.isalpha() and ch not in order:
            order[ch] = len(order)
    equation = equation.translate({ord(ch): 97 + i for ch, i in order.items()})
    # einsum_path reads only shapes: zero-stride views of one scalar cost no memory whatever the sizes
    arrays = [np.broadcast_to(np.zeros(()), tuple(s)) for s in shapes]
    report = np.einsum_path(equation, *arrays, optimize="optimal")[1]
    for line in report.split("\n"):
        if "optimized flop" in line.lower():
            return int(float(line.split(":")[-1]))
    raise FlopsProfilerError(f"cannot count the flops of einsum {equation!r}")


def _einsum(equation: str, *operands: Any) -> tuple[int, int]:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return einsum_flops(equation, [o.shape for o in operands]), 0


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    macs = _prod(q.shape) * int(k.shape[-2]) + _prod(q.shape[:-1]) * int(k.shape[-2]) * int(v.shape[-1])
    return 2 * macs, macs


#: A counting rule: called with a counted function's arguments, returns ``(flops, MACs)`` of the call.
Formula = Callable[..., tuple[int, int]]

#: ``(owner, attribute, formula)`` of every function counted while a profile is active (DeepSpeed 0.19.8's
#: list). Owners are ``torch.nn.functional``, ``torch`` and ``torch.Tensor``.
COUNTED_FUNCTIONS: tuple[tuple[Any, str, Formula], ...] = (
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
MODULE_FORMULAS: dict[type, Callable[[nn.Module, tuple[Any, ...]], int]] = {
    nn.RNN: _rnn_module_flops,
    nn.GRU: _rnn_module_flops,
    nn.LSTM: _rnn_module_flops,
    nn.RNNCell: _rnn_cell_flops,
    nn.LSTMCell: _rnn_cell_flops,
    nn.GRUCell: _rnn_cell_flops,
}
