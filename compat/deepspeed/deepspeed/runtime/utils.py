"""``deepspeed.runtime.utils``: the helpers of DeepSpeed 0.19.8's ``runtime/utils.py`` that client code and the
suite use, with 0.19.8's signatures.

Provided (own code; the pipeline cuts are dscore's, :mod:`dscore.pipe.partition`): ``partition_uniform``,
``partition_balanced``, ``prefix_sum_inc``, ``get_global_norm``, ``move_to_device``, ``set_random_seed``,
``call_to_str``, ``see_memory_usage``. Every other public name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used (DeepSpeed's gradient-clipping, overflow-check and
partitioned-tensor internals: dscore's engine does those inside its ZeRO stage and precision plugins).
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from deepspeed._not_provided import refused_module_getattr
from dscore.pipe.partition import partition_balanced, partition_uniform

if TYPE_CHECKING:  # torch is imported where used: this module loads torch-free
    import torch

__all__ = [
    "call_to_str",
    "get_global_norm",
    "move_to_device",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "see_memory_usage",
    "set_random_seed",
]

__getattr__ = refused_module_getattr(
    __name__,
    "a DeepSpeed runtime internal (gradient clipping and norms over model-parallel groups, overflow checks, "
    "partitioned tensors, hook counting) that dscore's engine does inside its ZeRO-stage and precision plugins; "
    "read the results with engine.get_global_grad_norm() and the `gradient_clipping` config key",
)


def prefix_sum_inc(weights: Iterable[Any]) -> list[Any]:
    """Inclusive prefix sums of ``weights`` (``[3, 4, 5]`` -> ``[3, 7, 12]``); a new list."""
    out: list[Any] = []
    for w in weights:
        out.append(w if not out else out[-1] + w)
    return out


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of a list of per-group 2-norms, ``sqrt(sum(n ** 2))``; ``inf`` when any norm is ``inf``,
    ``-inf`` or NaN (DeepSpeed's overflow marker), as in 0.19.8."""
    norms = [float(n) for n in norm_list]
    if any(math.isinf(n) or math.isnan(n) for n in norms):
        return float("inf")
    return math.sqrt(sum(n * n for n in norms))


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """Move the tensors in ``item`` (a tensor or nested lists/tuples/dicts of them) to ``device``.

    Like DeepSpeed 0.19.8: only objects for which ``criterion_func`` returns true are moved, in place (their
    ``.data`` is replaced, so parameters stay the same objects) and returned; containers are rebuilt with the
    same type family (list, tuple, dict); everything else is returned as is. With ``criterion_func=None``
    nothing is moved.
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (``seed % 2**32``) when NumPy is installed, and torch
    (``seed % 2**63``, every device through ``torch.manual_seed``)."""
    import torch

    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for dscore
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``"base(arg1, arg2, key=value)"`` with each value's ``repr``."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and the accelerator's and host's memory use, on rank 0 only, when ``force``.

    Device figures in GB (2**30 bytes), from the current accelerator: allocated (MA), peak allocated (Max_MA),
    reserved by the caching allocator (CA), peak reserved (Max_CA); then the host's used virtual memory (psutil).
    The accelerator's peak counters are reset afterwards, so the next call reports the peak since this one
    (DeepSpeed 0.19.8's behaviour). ``force=False`` prints nothing, as in DeepSpeed.
    """
    if not force:
        return
    import deepspeed.comm as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    import psutil

    from deepspeed.accelerator import get_accelerator

    gc.collect()  # so the host figure does not count garbage awaiting a collection
    acc = get_accelerator()
    gb = float(2**30)
    print(message)
    print(f"MA {round(acc.memory_allocated() / gb, 2)} GB Max_MA {round(acc.max_memory_allocated() / gb, 2)} GB "
          f"CA {round(acc.memory_reserved() / gb, 2)} GB Max_CA {round(acc.max_memory_reserved() / gb, 2)} GB")
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {round((vm.total - vm.available) / gb, 2)} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()
