"""``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``: the base class integrations test optimizers
against (``isinstance(opt, DeepSpeedOptimizer)``).

dscore's ZeRO stages step plain ``torch.optim.Optimizer`` objects over their partitions, and the optimizer
``deepspeed.initialize`` returns is one; so ``torch.optim.Optimizer`` is the base class here.
"""

from __future__ import annotations

from torch.optim import Optimizer as DeepSpeedOptimizer

ZeROOptimizer = DeepSpeedOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
