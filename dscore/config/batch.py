"""The batch-size triangle, derived exactly as DeepSpeed 0.19.8 does, with better errors.

``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
Derivation order (integer floor division, as DeepSpeed's ``_set_batch_related_parameters``):

==========================  ==============================================
given                       derived
==========================  ==============================================
all three                   nothing (then checked)
train, micro                accumulation = (train // micro) // world
train, accumulation         micro = (train // world) // accumulation
micro, accumulation         train = micro * accumulation * world
train only                  accumulation = 1, micro = train // world
micro only                  accumulation = 1, train = micro * world
accumulation only / none    error
==========================  ==============================================

``"auto"`` for one key counts as absent when the other two are concrete; otherwise it cannot be derived
deterministically and is reported as unresolved. Where DeepSpeed's floors hide the cause (it reports a
derived 0 or an unequal product), dscore says which number does not divide which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dscore.config.base import is_auto
from dscore.errors import ConfigError

__all__ = ["BATCH_KEYS", "BatchSizes", "resolve_batch"]

TB = "train_batch_size"
MB = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TB, MB, GAS)


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triangle (all ints > 0) and what was derived."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    derived: tuple[str, ...]


def _as_int(key: str, value: Any, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{source}: {key} = {value!r} must be a positive integer",
            path=key,
            source=source,
        )
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigError(f"{source}: {key} = {value!r} must be a positive integer", path=key, source=source)
        value = int(value)
    if value <= 0:
        raise ConfigError(f"{source}: {key} = {value} must be greater than 0", path=key, source=source)
    return value


def _multiples_near(value: int, step: int) -> list[int]:
    """The multiples of ``step`` just below (when > 0) and just above ``value``."""
    below = (value // step) * step
    return [m for m in (below, below + step) if m > 0 and m != value]


def _divisor_near(n: int, target: int) -> int:
    """The divisor of ``n`` (> 0) nearest ``target``; the smaller one on a tie."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return min({*small, *(n // d for d in small)}, key=lambda d: (abs(d - target), d))


def _either(options: list[str]) -> str:
    """``"set a, or b"``: the settings that would satisfy the triangle, nearest first."""
    return "Set " + ", or ".join(options) + "."


def _set_tb(values: list[int]) -> str:
    return f"{TB} to " + " or ".join(str(v) for v in values)


def resolve_batch(raw: dict[str, Any], *, world_size: int, world_size_source: str, source: str) -> BatchSizes:
    """Resolve the three batch keys of the top-level dict ``raw`` for ``world_size`` ranks.

    Args:
        raw: the top-level config dict (read only).
        world_size: the triangle's world size (> 0): the data-parallel size, with tensor-parallel ranks
            counted as DeepSpeed does (:func:`dscore.parallel.mesh.batch_world_size`).
        world_size_source: where the world size came from, for messages (``"--world-size"``).
        source: the config's name (file path or ``"<dict>"``), for messages.

    Raises:
        ConfigError: a value is not a positive integer, too few keys are given, ``"auto"`` cannot be
            derived, or the values are inconsistent. The message names every value, the world size and
            where it came from, and the nearest settings that would satisfy the triangle (``"Set
            gradient_accumulation_steps to 2, or train_batch_size to 8."``); ``path`` is the key at fault.
    """
    where = f"world size {world_size} ({world_size_source})"
    autos = [k for k in BATCH_KEYS if is_auto(raw.get(k))]
    values: dict[str, int | None] = {
        k: None if is_auto(raw.get(k)) else _as_int(k, raw.get(k), source) for k in BATCH_KEYS
    }
    given = [k for k in BATCH_KEYS if values[k] is not None]
    if autos and len(given) < 2:
        listed = ", ".join(f"{k} = {raw.get(k)!r}" for k in BATCH_KEYS if k in raw)
        raise ConfigError(
            f'{source}: unresolved "auto" at {", ".join(autos)}: dscore derives a batch key only when the other two '
            f"are concrete integers ({listed}; {where}).",
            path=autos[0],
            source=source,
            errors=[(k, 'unresolved "auto"') for k in autos],
        )
    tb, mb, gas = values[TB], values[MB], values[GAS]
    w = world_size

    def show() -> str:
        return f"{TB} = {tb}, {MB} = {mb}, {GAS} = {gas}, {where}"

    derived: list[str] = []
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        if tb % (mb * w):
            fixes = [_set_tb(_multiples_near(tb, mb * w))]
            if tb % w == 0:
                fixes.append(f"{MB} to {_divisor_near(tb // w, mb)}")
            raise ConfigError(
                f"{source}: {TB} = {tb} is not divisible by {MB} x world size = {mb} x {w} = {mb * w}, so "
                f"{GAS} cannot be derived ({show()}). {TB} must equal {MB} x {GAS} x world size. "
                f"{_either(fixes)}",
                path=TB,
                source=source,
            )
        gas = (tb // mb) // w
        derived.append(GAS)
    elif tb is not None and gas is not None:
        if tb % (gas * w):
            fixes = [_set_tb(_multiples_near(tb, gas * w))]
            if tb % w == 0:
                fixes.append(f"{GAS} to {_divisor_near(tb // w, gas)}")
            raise ConfigError(
                f"{source}: {TB} = {tb} is not divisible by {GAS} x world size = {gas} x {w} = {gas * w}, so "
                f"{MB} cannot be derived ({show()}). {TB} must equal {MB} x {GAS} x world size. "
                f"{_either(fixes)}",
                path=TB,
                source=source,
            )
        mb = (tb // w) // gas
        derived.append(MB)
    elif mb is not None and gas is not None:
        tb = mb * gas * w
        derived.append(TB)
    elif tb is not None:
        if tb % w:
            raise ConfigError(
                f"{source}: {TB} = {tb} is not divisible by the {where}; with {GAS} = 1 each rank would need "
                f"{tb}/{w} samples per micro batch. {_either([_set_tb(_multiples_near(tb, w))])[:-1]} "
                f"(a multiple of {w}), or give {MB} and {GAS}.",
                path=TB,
                source=source,
            )
        gas = 1
        mb = tb // w
        derived += [MB, GAS]
    elif mb is not None:
        gas = 1
        tb = mb * w
        derived += [TB, GAS]
    else:
        raise ConfigError(
            f"{source}: either {TB} or {MB} needs to be provided ({show()}).",
            path=TB,
            source=source,
        )
    assert tb is not None and mb is not None and gas is not None
    if tb != mb * gas * w:
        fixes = []
        if tb % (mb * w) == 0:
            fixes.append(f"{GAS} to {tb // (mb * w)}")
        if tb % (gas * w) == 0:
            fixes.append(f"{MB} to {tb // (gas * w)}")
        fixes.append(f"{TB} to {mb * gas * w}")
        raise ConfigError(
            f"{source}: {TB} must equal {MB} x {GAS} x world size, but {tb} != {mb} x {gas} x {w} = "
            f"{mb * gas * w} ({show()}). {_either(fixes)}",
            path=TB,
            source=source,
        )
    return BatchSizes(tb, mb, gas, tuple(derived))
