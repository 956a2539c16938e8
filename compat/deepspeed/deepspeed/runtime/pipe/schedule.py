"""``deepspeed.runtime.pipe.schedule``: DeepSpeed 0.19.8's pipeline instruction schedules, not provided.

dscore's pipeline engine runs its own 1F1B schedule inside ``train_batch`` / ``eval_batch`` and does not
expose it as DeepSpeed's stream of ``PipeInstruction`` objects, so these names import and raise
:class:`deepspeed._not_provided.NotProvidedError` when used.
"""

from __future__ import annotations

from deepspeed._not_provided import not_provided

_NAMES = (
    "PipeSchedule", "InferenceSchedule", "TrainSchedule", "DataParallelSchedule", "DualPipeVSchedule",
    "PipeInstruction", "OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction", "LoadMicroBatch",
    "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P",
)
__all__ = list(_NAMES)

_REASON = ("dscore's pipeline engine runs its 1F1B schedule internally (engine.train_batch / eval_batch) and does "
           "not expose DeepSpeed's instruction stream")
globals().update({name: not_provided(f"{__name__}.{name}", _REASON) for name in _NAMES})
