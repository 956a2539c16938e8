"""Encoding nested state (dicts, lists, numbers, strings, tensors) as JSON plus a flat tensor map.

This is how dscore stores optimizer state, the LR scheduler, counters and the user's ``client_state``
without pickle: :func:`encode` replaces every tensor by a reference into a flat ``{key: tensor}`` map
(written to a safetensors file) and every value JSON cannot hold exactly by a one-key marker object;
:func:`decode` inverts it. Only these types are accepted, anything else is refused with a
:class:`~dscore.errors.CheckpointError` naming the key path:

* ``None``, ``bool``, ``int``, ``float`` (``nan``/``inf`` included), ``str``
* ``list``, ``tuple`` (comes back as a tuple), ``dict`` (and subclasses such as ``OrderedDict``; comes back
  as a plain ``dict``) whose keys are ``str``, ``int``, ``float``, ``bool`` or ``None``
* dense ``torch.Tensor`` (``nn.Parameter`` comes back as a plain tensor, on the CPU)

Subclasses of the scalar types (``numpy.float64``, ``IntEnum``) are refused rather than silently turned
into their base type, so what comes back is what was saved.

Markers are JSON objects with exactly one key starting with ``$``; a dict whose own keys start with ``$``
(or are not strings) is stored as ``{"$dict": [[key, value], ...]}``, so decoding is unambiguous.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dscore.errors import CheckpointError

__all__ = ["ALLOWED_TYPES_TEXT", "decode", "encode"]

ALLOWED_TYPES_TEXT = "None, bool, int, float, str, list, tuple, dict (keys: str/int/float/bool/None) and torch.Tensor"
_SCALARS = (type(None), bool, int, str)


def _path_text(root: str, path: tuple[Any, ...]) -> str:
    return root + "".join(f"[{p!r}]" for p in path)


def encode(obj: Any, *, root: str, tensor_prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Return a JSON-compatible encoding of ``obj``; tensors are added to ``tensors``.

    Args:
        obj: the value to encode.
        root: how the value is named in error messages (``"client_state"``).
        tensor_prefix: prefix of the keys given to tensors in ``tensors`` (``"client/"``).
        tensors: receives ``key -> tensor`` for every tensor found.

    Raises:
        CheckpointError: a value of a type outside :data:`ALLOWED_TYPES_TEXT`, or a reference cycle; the
            message gives the key path (``client_state['args']``) and the offending type.
    """
    active: set[int] = set()

    def enc(value: Any, path: tuple[Any, ...]) -> Any:
        t = type(value)
        if t in _SCALARS:
            return value
        if t is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.is_complex():
                raise CheckpointError(
                    f"{_path_text(root, path)}: a {value.layout} {value.dtype} tensor cannot be stored in a "
                    "checkpoint; only dense real-valued tensors can"
                )
            key = tensor_prefix + "/".join(str(p) for p in path)
            if key in tensors:
                key = f"{key}#{len(tensors)}"
            tensors[key] = value
            return {"$tensor": key}
        if t is list or t is tuple or isinstance(value, dict):
            if id(value) in active:
                raise CheckpointError(f"{_path_text(root, path)}: contains itself (a reference cycle)")
            active.add(id(value))
            try:
                if t is list:
                    return [enc(v, path + (i,)) for i, v in enumerate(value)]
                if t is tuple:
                    return {"$tuple": [enc(v, path + (i,)) for i, v in enumerate(value)]}
                plain = True
                for k in value:
                    if type(k) is str:
                        plain = plain and not k.startswith("$")
                    elif type(k) in (int, float, bool, type(None)):
                        plain = False
                    else:
                        raise CheckpointError(
                            f"{_path_text(root, path)}: dict key {k!r} of type {type(k).__module__}."
                            f"{type(k).__qualname__} cannot be stored in a checkpoint (allowed keys: str, int, "
                            "float, bool, None)"
                        )
                if plain:
                    return {k: enc(v, path + (k,)) for k, v in value.items()}
                return {"$dict": [[enc(k, path + ("<key>",)), enc(v, path + (k,))] for k, v in value.items()]}
            finally:
                active.discard(id(value))
        raise CheckpointError(
            f"{_path_text(root, path)}: a value of type {t.__module__}.{t.__qualname__} cannot be stored in a "
            f"checkpoint (checkpoints are loaded without pickle; allowed: {ALLOWED_TYPES_TEXT}). Convert it "
            "first (for example vars(namespace), float(numpy_value), tensor.tolist())"
        )

    return enc(obj, ())


def decode(data: Any, tensors: dict[str, torch.Tensor], *, source: str) -> Any:
    """Invert :func:`encode`.

    Args:
        data: the JSON value.
        tensors: the tensor map read from the companion safetensors file.
        source: the file the data came from, for error messages.

    Raises:
        CheckpointError: a tensor reference is missing from ``tensors`` or a marker is unknown.
    """

    def dec(value: Any) -> Any:
        if isinstance(value, list):
            return [dec(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (key,) = value
            if key.startswith("$"):
                inner = value[key]
                if key == "$tensor":
                    try:
                        return tensors[inner]
                    except KeyError:
                        raise CheckpointError(f"{source}: tensor {inner!r} is referenced but not stored") from None
                if key == "$tuple":
                    return tuple(dec(v) for v in inner)
                if key == "$float":
                    return float(inner)
                if key == "$dict":
                    return {dec(k): dec(v) for k, v in inner}
                raise CheckpointError(f"{source}: unknown marker {key!r} (written by a newer dscore?)")
        return {k: dec(v) for k, v in value.items()}

    return dec(data)
