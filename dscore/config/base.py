"""Building blocks shared by the core config model and every plugin's section model (torch-free).

A plugin's ``config.py`` declares its ds_config section as a subclass of :class:`SectionModel` (or a
plain pydantic model using :data:`SECTION_MODEL_CONFIG`) and uses the number types below, which behave
like DeepSpeed's pydantic fields except that a JSON boolean is never accepted as a number and NaN /
infinity are rejected.

Two optional class-level hooks let a section model take part in loading:

* ``dscore_auto``: ``{field_name: rule}`` for fields that accept the string ``"auto"``. ``rule`` is
  ``"value"`` when ``"auto"`` is itself a meaningful value of the field (kept as written), or one of the
  keys of :data:`MODEL_AUTO_FORMULAS` when dscore fills it in once the model's hidden size is known
  (:meth:`dscore.config.DscoreConfig.resolve_model_auto`). ``"auto"`` anywhere else is an error.
* ``migrate_legacy(value, *, root, warn)`` (classmethod): called with the raw section value before
  validation; returns the migrated value. ``root`` is the working copy of the whole top-level dict (a
  migrator may pop a legacy top-level key it consumes), ``warn(message)`` records a warning. It may
  raise :class:`dscore.errors.ConfigError` with a dotted path to refuse a form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "SECTION_MODEL_CONFIG",
    "SectionModel",
    "MODEL_AUTO_FORMULAS",
    "Int",
    "PositiveInt",
    "NonNegativeInt",
    "Float",
    "PositiveFloat",
    "NonNegativeFloat",
    "is_auto",
    "no_effect",
    "not_implemented",
    "field_status",
]

#: The pydantic settings every ds_config model uses: unknown keys rejected, attribute docstrings become
#: field descriptions (the one source of help text), instances immutable, aliases and names accepted.
SECTION_MODEL_CONFIG = ConfigDict(
    extra="forbid",
    use_attribute_docstrings=True,
    frozen=True,
    populate_by_name=True,
)

#: Formulas for model-dependent ``"auto"`` values, from the model's hidden size ``h`` (an int > 0).
#: They are the ones the Hugging Face Trainer's DeepSpeed integration uses, so configs written for it
#: resolve to the same numbers: ``reduce_bucket_size = h*h``,
#: ``stage3_prefetch_bucket_size = int(0.9*h*h)``, ``stage3_param_persistence_threshold = 10*h``.
MODEL_AUTO_FORMULAS: dict[str, Callable[[int], int]] = {
    "hidden^2": lambda h: h * h,
    "0.9*hidden^2": lambda h: int(0.9 * h * h),
    "10*hidden": lambda h: 10 * h,
}


def is_auto(value: Any) -> bool:
    """True when ``value`` is the string ``"auto"`` (case-sensitive, as DeepSpeed and HF write it)."""
    return isinstance(value, str) and value == "auto"


def _reject_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def _integral(value: Any) -> Any:
    """Accept integral floats (``2e8``) as ints, like DeepSpeed's pydantic fields; reject bools."""
    value = _reject_bool(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"expected an integer, got {value!r}")
        if value != int(value):
            raise ValueError(f"expected an integer, got the fraction {value!r}")
        return int(value)
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return value


#: An integer (integral floats such as ``2e8`` accepted; booleans rejected).
Int = Annotated[int, BeforeValidator(_integral)]
#: An integer > 0.
PositiveInt = Annotated[int, BeforeValidator(_integral), Field(gt=0)]
#: An integer >= 0.
NonNegativeInt = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
#: A finite float (booleans, NaN and infinity rejected).
Float = Annotated[float, BeforeValidator(_reject_bool), AfterValidator(_finite)]
#: A finite float > 0.
PositiveFloat = Annotated[float, BeforeValidator(_reject_bool), AfterValidator(_finite), Field(gt=0)]
#: A finite float >= 0.
NonNegativeFloat = Annotated[float, BeforeValidator(_reject_bool), AfterValidator(_finite), Field(ge=0)]


def no_effect(reason: str) -> dict[str, Any]:
    """``json_schema_extra`` of a field dscore accepts but that changes nothing (a DeepSpeed tuning knob):
    setting it logs a warning naming its key path and ``reason``. Listed as *warned* by
    ``python -m dscore.config.audit``."""
    return {"dscore_status": "warned", "dscore_reason": reason}


def not_implemented(reason: str) -> dict[str, Any]:
    """``json_schema_extra`` of a field whose non-default values would change training and that dscore does
    not implement: such a value is a :class:`dscore.errors.ConfigError` naming the key path and ``reason``
    (the default is accepted). Listed as *refused* by ``python -m dscore.config.audit``."""
    return {"dscore_status": "refused", "dscore_reason": reason}


def field_status(field: Any) -> tuple[str, str] | None:
    """``("warned" | "refused", reason)`` from a pydantic ``FieldInfo`` marked with :func:`no_effect` /
    :func:`not_implemented`, else None."""
    extra = getattr(field, "json_schema_extra", None)
    if isinstance(extra, dict) and extra.get("dscore_status") in ("warned", "refused"):
        return str(extra["dscore_status"]), str(extra.get("dscore_reason", ""))
    return None


class SectionModel(BaseModel):
    """Base class of ds_config section models: :data:`SECTION_MODEL_CONFIG` plus the loading hooks.

    Subclasses declare fields with attribute docstrings; see the module docstring for ``dscore_auto``
    and ``migrate_legacy``.
    """

    model_config = SECTION_MODEL_CONFIG

    dscore_auto: ClassVar[dict[str, str]] = {}
