"""CPU offload of ZeRO stages 1-3: host buffers, the offload settings, and THE offloaded optimizer step.

Single step point: every built-in stage (1, 2 and 3) steps its host-resident fp32 partitions through
:func:`step_offloaded` and nowhere else (its one caller is :func:`dscore_plugins.zero.step.step_partitions`,
the shared step of the partitioned stages), so what happens around an offloaded step (for example
swapping optimizer state in from and out to NVMe) is added in this one function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError
from dscore_plugins.zero.nvme_optimizer import swapper_for

if TYPE_CHECKING:
    from dscore.accelerator import Accelerator

__all__ = ["host_tensor", "offload_device", "offload_pin", "step_offloaded"]


def offload_device(block: Any, key: str) -> str:
    """``"none"``, ``"cpu"`` or ``"nvme"``: the device of a validated ``offload_optimizer`` /
    ``offload_param`` block (NVMe: :mod:`.nvme_optimizer`, :mod:`.nvme_params`).

    Args:
        block: the validated block (``OffloadOptimizerConfig`` / ``OffloadParamConfig``) or None.
        key: its key under ``zero_optimization`` (for the error message).
    """
    if block is None:
        return "none"
    dev = str(block.device)
    return dev


def offload_pin(block: Any) -> bool:
    """``pin_memory`` of a validated offload block (False without a block)."""
    return block is not None and bool(block.pin_memory)


def host_tensor(numel: int, dtype: torch.dtype, pin: bool, accelerator: Accelerator) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of ``numel`` elements, page-locked by ``accelerator`` when ``pin``.

    Pinning is the accelerator's call (the CPU accelerator returns the tensor as it is), never a
    direct ``torch.cuda`` query.
    """
    # allocated pinned in one step (never a plain buffer plus its pinned copy: twice the peak host memory)
    t = accelerator.empty_pinned(numel, dtype) if pin else torch.empty(numel, dtype=dtype, device="cpu")
    return t.zero_()


def step_offloaded(optimizer: torch.optim.Optimizer, partitions: Sequence[torch.Tensor]) -> None:
    """Step ``optimizer`` over the host-resident fp32 master partitions (offload_optimizer: cpu).

    The single place stages 1-3 run an offloaded optimizer step (see the module docstring).

    Args:
        optimizer: the optimizer whose groups hold exactly ``partitions`` (1-D fp32 CPU tensors, each
            with its gradient partition in ``.grad``, already unscaled and clipped).
        partitions: every master partition the step updates, in optimizer group order.

    After the call the partitions hold the updated weights; copying them back to the device parameters
    is the stage's (an all-gather in stages 1-2, a copy into the partition in stage 3). With
    ``offload_optimizer.device: nvme`` the masters and state are in swap files: the step runs sub-group
    by sub-group in :meth:`dscore_plugins.zero.nvme_optimizer.NVMeOptimizerSwapper.step`, which also
    writes the updated values into the stage's compute partitions.
    """
    swapper = swapper_for(optimizer)
    if swapper is not None:
        swapper.step()
        return
    for part in partitions:
        if part.device.type != "cpu":
            raise ConfigError(
                f"offload_optimizer: a master partition lives on {part.device}, not on the CPU; the offloaded "
                "step only updates host-resident partitions",
                path="zero_optimization.offload_optimizer.device",
            )
    optimizer.step()
