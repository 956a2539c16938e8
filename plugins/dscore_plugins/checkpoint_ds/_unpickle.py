"""Reading DeepSpeed's pickles without running code from them.

DeepSpeed writes its checkpoint files with ``torch.save``: pickles that may name any importable callable.
Every file is read here with ``torch.load(weights_only=True)`` (PyTorch's restricted unpickler: tensors,
storages, containers, numbers, strings, dtypes) plus an explicit allow-list of the few DeepSpeed types
DeepSpeed 0.19.8 stores, each mapped to an inert stand-in class defined below (DeepSpeed itself is never
imported). Anything else in a file is refused with a :class:`~dscore.errors.CheckpointError` naming the
type and the file, before anything is built from it.

Allowed DeepSpeed names (found by loading real 0.19.8 checkpoints of ZeRO stages 0-3, fp32/bf16):

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler`` -> :class:`DSLossScaler`
  (the optimizer files' ``loss_scaler``; attributes ``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
  ``cur_hysteresis``, ... kept as plain values)
* ``deepspeed.runtime.zero.config.ZeroStageEnum`` -> :class:`DSZeroStage` (an ``int``)
* ``deepspeed.utils.tensor_fragment.fragment_address`` -> :class:`DSFragment` (``start``, ``numel``)
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

from dscore.errors import CheckpointError

__all__ = ["ALLOWED_DEEPSPEED_GLOBALS", "DSFragment", "DSLossScaler", "DSZeroStage", "safe_load"]

_PLAIN = (type(None), bool, int, float, str)


def _plain_state(obj: object, state: object, what: str) -> dict[str, Any]:
    """Accept a BUILD state only when it is a dict of plain values (and torch dtypes)."""
    import torch

    if not isinstance(state, dict):
        raise pickle.UnpicklingError(f"{what}: unexpected pickled state of type {type(state).__name__}")
    out: dict[str, Any] = {}
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, (*_PLAIN, torch.dtype)):
            raise pickle.UnpicklingError(f"{what}: attribute {k!r} holds a {type(v).__name__}, expected a plain value")
        out[k] = v
    return out


class DSLossScaler:
    """Inert stand-in for DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` (attributes only).

    Attributes (as DeepSpeed 0.19.8 sets them): ``cur_scale`` (float), ``dynamic`` (bool); dynamic ones
    also ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``, ``min_scale``,
    ``delayed_shift``, ``cur_hysteresis``, ``consecutive_hysteresis``, ``raise_error_at_min_scale``,
    ``dtype``.
    """

    def __setstate__(self, state: object) -> None:
        self.__dict__.update(_plain_state(self, state, "DeepSpeed loss scaler"))

    def as_dict(self) -> dict[str, Any]:
        """The attributes as a plain dict."""
        return dict(self.__dict__)


class DynamicDSLossScaler(DSLossScaler):
    """Stand-in for ``DynamicLossScaler`` (same attributes, kept apart so the type is known)."""


class DSZeroStage(int):
    """Stand-in for DeepSpeed's ``ZeroStageEnum`` (an ``int`` 0-3)."""

    def __new__(cls, value: object = 0) -> DSZeroStage:
        if type(value) is not int or not 0 <= value <= 3:
            raise pickle.UnpicklingError(f"ZeroStageEnum value {value!r} is not a ZeRO stage 0-3")
        return int.__new__(cls, value)


class DSFragment:
    """Stand-in for DeepSpeed's ``fragment_address``: ``start`` (offset of a parameter's slice in one
    rank's flat partition, elements) and ``numel`` (its length)."""

    start: int
    numel: int

    @classmethod
    def of(cls, start: int, numel: int) -> DSFragment:
        """A fragment from plain values (the ``{"start", "numel"}`` dicts dscore's writer stores)."""
        frag = cls.__new__(cls)
        frag.__setstate__({"start": start, "numel": numel})
        return frag

    def __setstate__(self, state: object) -> None:
        plain = _plain_state(self, state, "DeepSpeed fragment_address")
        if set(plain) != {"start", "numel"} or not all(type(v) is int and v >= 0 for v in plain.values()):
            raise pickle.UnpicklingError(f"fragment_address state {plain!r} is not {{start, numel}} non-negative ints")
        self.__dict__.update(plain)


#: DeepSpeed name -> stand-in: the whole allow-list beyond torch's own weights-only types.
ALLOWED_DEEPSPEED_GLOBALS: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": DSLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicDSLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": DSZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": DSFragment,
}

_UNSUPPORTED_RE = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")


def safe_load(path: str, *, mmap: bool = True) -> Any:
    """Load one DeepSpeed checkpoint file without executing code from it.

    Args:
        path: a ``*.pt`` file written by DeepSpeed's ``torch.save``.
        mmap: map tensor storages from the file instead of reading them (only the slices later touched
            are read; falls back to a plain read for files in the legacy non-zip format).

    Returns:
        The unpickled object: dicts/lists of tensors (CPU) and plain values; DeepSpeed objects become the
        stand-ins of :data:`ALLOWED_DEEPSPEED_GLOBALS`.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointError: the file needs a type outside the allow-list (the type and file are named), or
            is not a readable torch file.
    """
    import torch

    from dscore.errors import CheckpointNotFoundError

    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"DeepSpeed checkpoint file {path} does not exist")
    allowed: list[Any] = [(cls, name) for name, cls in ALLOWED_DEEPSPEED_GLOBALS.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if mmap and "mmap" in str(exc).lower():  # legacy (non-zip) format cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = _UNSUPPORTED_RE.search(text)
        if m:
            raise CheckpointError(
                f"{path} needs the type {m.group(1)} to load, which is not on dscore's allow-list; refusing to "
                "unpickle it (a checkpoint file could run arbitrary code through it). DeepSpeed types allowed: "
                f"{', '.join(sorted(ALLOWED_DEEPSPEED_GLOBALS))}; plus tensors, containers and plain values"
            ) from None
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        useful = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
        first = (useful or lines or [text])[0]
        raise CheckpointError(f"{path} cannot be loaded safely: {first}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable torch checkpoint file: {type(exc).__name__}: {exc}") from None
