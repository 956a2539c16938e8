"""``deepspeed.runtime.swap_tensor``: DeepSpeed 0.19.8's ZeRO-Infinity swap package.

Only its public constant is provided: ``MIN_SWAPPABLE_BYTES`` (DeepSpeed's value, 1 MiB: the smallest tensor its
async-I/O swappers move; DeepSpeed's tests size models with it). DeepSpeed's swapper classes
(``partitioned_param_swapper``, ``partitioned_optimizer_swapper``, ...) are internal to its ZeRO-Infinity and are
refused when used (``deepspeed._refused_tree``); dscore's NVMe offload is the ``offload_param`` /
``offload_optimizer`` ``"device": "nvme"`` config (:mod:`dscore_plugins.zero.nvme_swap`).
"""

from __future__ import annotations

__all__ = ["MIN_SWAPPABLE_BYTES"]

#: DeepSpeed 0.19.8's ``swap_tensor.utils.MIN_AIO_BYTES`` (bytes)
MIN_SWAPPABLE_BYTES = 1024**2
