"""Activation checkpointing (the ``activation_checkpointing`` model transform's machinery and the names
``dscore.checkpointing`` exports: ``checkpoint``, ``configure``, ``settings``, ...).

* :mod:`.state`: the process-wide settings (:func:`configure`, :func:`settings`, :func:`reset`,
  :func:`set_num_layers`), torch-free;
* :mod:`.function`: the recompute-in-backward autograd function (imports torch, on the first checkpoint);
* :func:`checkpoint` (here): runs ``fn(*args)`` saving only ``args``, recomputing in backward.

``dscore.checkpointing.checkpoint`` works with no runtime (model code calls it): outside ``dscore.initialize``
the thin name resolves over the installed plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dscore_plugins.parallel.checkpointing.state import (
    CheckpointingError,
    CheckpointSettings,
    _reset_for_tests,  # noqa: F401 - dscore.checkpointing._reset_for_tests (tests)
    configure,
    current,
    is_configured,
    reset,
    set_num_layers,
    settings,
)

__all__ = [
    "CheckpointSettings",
    "CheckpointingError",
    "checkpoint",
    "configure",
    "current",
    "is_configured",
    "reset",
    "set_num_layers",
    "settings",
]


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args)`` saving only ``args`` for backward; recompute it in backward.

    Args:
        function: any callable (a module, a block's forward); it must be deterministic given its inputs
            and the RNG state (dropout is fine: the RNG state is replayed).
        *args: positional arguments. Tensors are saved (moved to CPU / into contiguous buffers per the
            settings); other values are kept as they are. Keyword arguments are not supported (as
            DeepSpeed): bind them with a lambda or ``functools.partial``.

    Returns:
        What ``function`` returns: a tensor, or a tuple/list of tensors and other values (returned as a
        tuple). Floating-point output tensors require grad when grad mode is on.

    Under ``torch.compile`` the call is traced (no graph break) as torch's non-reentrant checkpoint, whose
    recompute draws the forward's random numbers on every backend: AOTAutograd backends (``aot_eager``,
    ``inductor``) recompute from the forward's functionalised seeds, and where dynamo's graph runs as Python
    (``backend="eager"``, on which torch itself does not replay the RNG under compile) dscore's recompute
    context swaps in the forward's CPU and accelerator RNG states and restores the caller's afterwards.
    With ``cpu_checkpointing``, ``contiguous_memory_optimization``, ``synchronize_checkpoint_boundary`` or
    ``profile`` on, which a compiled graph cannot express, the call runs eagerly instead (a graph break per
    call; a warning names the keys once) and those settings work as without compile.
    ``partition_activations`` has no effect at dscore's model-parallel size 1, compiled or not.

    Raises:
        CheckpointingError: see :class:`CheckpointingError` (contiguous buffer misuse); keyword arguments
            (DeepSpeed's checkpoint takes positional arguments only).
    """
    if kwargs:
        raise CheckpointingError(
            f"dscore.checkpointing.checkpoint() takes the function's arguments positionally only (as DeepSpeed's "
            f"checkpoint), got keyword argument(s) {', '.join(sorted(kwargs))}: bind them first, e.g. "
            f"checkpoint(functools.partial(fn, {next(iter(sorted(kwargs)))}=...), *args)"
        )
    from dscore_plugins.parallel.checkpointing.function import run_checkpoint

    settings, generation = current()
    return run_checkpoint(function, args, settings, generation)
