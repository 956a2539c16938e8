"""Config values that libraries driving DeepSpeed write, converted to what they mean in DeepSpeed 0.19.8.

Hugging Face Accelerate puts ``"steps_per_print": inf`` into every config it hands to
``deepspeed.initialize`` (to silence DeepSpeed's progress log), and TRL adds top-level keys spelled with
dots (``"zero_optimization.reduce_bucket_size": ...``). DeepSpeed accepts both: ``global_steps % inf`` is
never 0, so nothing is printed, and its config reader looks keys up by nesting, so a dotted top-level key is
never read. ``dscore.initialize`` refuses both (``steps_per_print`` must be a positive integer; unknown
keys are errors), which stays so: a user writing dscore configs gets the strict reading.

:func:`convert_client_values` is the one place that gives those values DeepSpeed's meaning, with a warning
for each; the ``deepspeed`` compatibility distribution (``compat/deepspeed``) calls it on the config before
``dscore.initialize``. It changes nothing else: every other key is still validated strictly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["convert_client_values"]


def _is_infinite(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isinf(value) and value > 0
    if isinstance(value, str):
        return value.strip().lower() in ("inf", "+inf", "infinity", "+infinity")
    return False


def convert_client_values(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Give the config values client libraries write DeepSpeed 0.19.8's meaning.

    Args:
        data: a ds_config as a mapping (already read from its file; not mutated).

    Returns:
        ``(converted, warnings)``: a deep copy of ``data`` where

        * ``steps_per_print`` equal to positive infinity (the float, or the text ``"inf"``/``"Infinity"``,
          as Accelerate writes it) is removed: no periodic progress log, which is what DeepSpeed does with
          it (dscore's default ``None``);
        * every top-level key containing a dot (``"zero_optimization.reduce_bucket_size"``, as TRL writes
          them) is removed: DeepSpeed reads nested keys only, so the value never applied there either. The
          warning names the nested key the value would have to be written under to take effect.

        and one warning text per change. Other values (a negative or fractional ``steps_per_print``,
        unknown nested keys) are left for the strict validation of :func:`dscore.config.load_config`.
    """
    out = copy.deepcopy(dict(data))
    warnings: list[str] = []
    if "steps_per_print" in out and _is_infinite(out["steps_per_print"]):
        del out["steps_per_print"]
        warnings.append(
            "steps_per_print: inf means no periodic progress log (as in DeepSpeed, where global_steps % inf is "
            "never 0); the key was dropped, which is dscore's default (None)"
        )
    for key in [k for k in out if isinstance(k, str) and "." in k]:
        value = out.pop(key)
        head, _, rest = key.partition(".")
        nested = out.get(head)
        present = isinstance(nested, Mapping) and rest.split(".")[0] in nested
        where = f"{head}: {{{rest!r}: ...}}" if not present else f"{head}.{rest} (which the config also sets)"
        warnings.append(
            f"top-level key {key!r} (value {value!r}) is not read by DeepSpeed, which looks keys up by nesting; "
            f"it was dropped and has no effect. To apply it, write it as {where}"
        )
    return out, warnings
