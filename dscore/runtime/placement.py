"""Moving and casting a model in place without losing its ``Parameter`` objects.

``torch.nn.Module.to`` keeps each ``Parameter`` object (it assigns ``param.data``) only when the old and
the new tensor have "compatible shallow-copy types", which torch grants to CPU, CUDA, MPS, HIP, XPU and
HPU tensors only. For an out-of-tree device (``PrivateUse1``: Ascend NPU, the test device of
``examples/plugins/dscore-testdevice``) it builds *new* ``Parameter`` objects instead, per module: tied
weights become two independent parameters (a GPT's embedding and output head train apart) and a client
optimizer built before ``dscore.initialize`` holds parameters the model no longer uses. Found by running
the GPT example on the test device (issue 28).

:func:`to_module` moves or casts with torch's swap-tensors conversion (``torch.utils.swap_tensors``,
``torch.__future__.set_swap_module_params_on_conversion``) exactly where torch would otherwise replace
the parameters, so every ``Parameter`` object — and so every tie and every optimizer reference — survives,
with its Python attributes (the swap would move them to the discarded tensor: MoE expert parameters lost
their ``allreduce = False`` / ``group_name`` tags and were reduced and partitioned as dense ones on the
test device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["to_module"]


def to_module(
    module: torch.nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """``module.to(device=device, dtype=dtype)`` in place, keeping every ``Parameter`` object (and tie).

    Args:
        module: the model; converted in place and returned.
        device: target device (``None``: unchanged).
        dtype: target floating-point dtype (``None``: unchanged; integer tensors are never cast).

    Returns:
        ``module``.
    """
    import torch

    probe = next(module.parameters(), None)
    if probe is None:
        return module.to(device=device, dtype=dtype)
    target = torch.empty(
        0,
        device=probe.device if device is None else device,
        dtype=dtype if dtype is not None and probe.is_floating_point() else probe.dtype,
    )
    if torch._has_compatible_shallow_copy_type(probe, target):
        return module.to(device=device, dtype=dtype)  # torch keeps the Parameter objects itself
    # swap_tensors swaps the Python attributes too: the kept Parameter objects would come out without
    # their tags (MoE experts' ``allreduce`` / ``group_name``, ``ds_*``, user attributes); put them back
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    attrs = {key: dict(t.__dict__) for key, t in tensors.items() if t.__dict__}
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to(device=device, dtype=dtype)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    for key, saved in attrs.items():
        tensors[key].__dict__.update(saved)
    return module
