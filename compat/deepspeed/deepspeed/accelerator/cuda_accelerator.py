"""``deepspeed.accelerator.cuda_accelerator.CUDA_Accelerator``: the accelerator object of dscore's ``cuda``
accelerator plugin (for ``set_accelerator(CUDA_Accelerator())``)."""

from __future__ import annotations

from deepspeed.accelerator._named import named_accelerator
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

__all__ = ["CUDA_Accelerator"]


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's accelerator object over a new instance of dscore's ``cuda`` accelerator.

    Raises:
        AcceleratorError: the ``cuda`` accelerator is not installed or not usable here.
    """

    def __init__(self) -> None:
        super().__init__(named_accelerator("cuda"))
