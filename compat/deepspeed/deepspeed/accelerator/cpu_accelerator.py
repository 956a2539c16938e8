"""``deepspeed.accelerator.cpu_accelerator.CPU_Accelerator``: the accelerator object of dscore's ``cpu``
accelerator plugin (for ``set_accelerator(CPU_Accelerator())``)."""

from __future__ import annotations

from deepspeed.accelerator._named import named_accelerator
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

__all__ = ["CPU_Accelerator"]


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's accelerator object over a new instance of dscore's ``cpu`` accelerator.

    Raises:
        AcceleratorError: the ``cpu`` accelerator is not installed or not usable here.
    """

    def __init__(self) -> None:
        super().__init__(named_accelerator("cpu"))
