"""``deepspeed.utils.comms_logging``: DeepSpeed 0.19.8's communication logger objects.

Not provided as objects: dscore's communication logging is the ``comms_logger`` config block (enabled,
verbose, prof_all, prof_ops, debug) read by :mod:`dscore.comm`, with ``deepspeed.comm.log_summary()``
printing the summary; each name here imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used.
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__,
    "DeepSpeed's CommsLogger object is not provided: dscore's communication logging is the `comms_logger` config "
    "block, its summary deepspeed.comm.log_summary()",
)
