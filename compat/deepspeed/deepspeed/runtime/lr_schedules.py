"""``deepspeed.runtime.lr_schedules``: DeepSpeed 0.19.8's LR-schedule names.

* the schedule classes ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``:
  dscore's (the ``lr_scheduler`` plugin units of those names, their ``exports`` module), resolved through the
  registry on first access, so a disabled unit raises the registry's error naming it;
* ``VALID_LR_SCHEDULES``: the schedules a ds_config may select (``scheduler.type``), read from the registry
  (its ``torch`` fall-back excluded, as DeepSpeed lists only its own);
* the string constants DeepSpeed names its schedules and their ``scheduler.params`` keys by (values of 0.19.8).
"""

from __future__ import annotations

from typing import Any

from dscore.exports import provided

_CLASSES = ("LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR")

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"

__all__ = [  # noqa: F822 - the classes and VALID_LR_SCHEDULES resolve on first access by __getattr__
    *_CLASSES,
    "VALID_LR_SCHEDULES",
    *(n for n in list(globals()) if n.isupper() and not n.startswith("_")),
]


def _names() -> list[str]:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    registry = Registry(create_plugin_manager())
    return [spec.name for spec in registry.specs("lr_scheduler") if spec.name != "torch"]


def __getattr__(name: str) -> Any:
    if name == "VALID_LR_SCHEDULES":
        value = _names()
    elif name in _CLASSES:
        value = provided("lr_scheduler", name, name, public_name=f"{__name__}.{name}")
    else:
        raise AttributeError(f"deepspeed.runtime.lr_schedules.{name} is not provided by dscore's compatibility layer")
    globals()[name] = value
    return value
