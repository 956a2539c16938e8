"""What dscore does with every top-level key DeepSpeed 0.19.8 knows.

Three groups:

* **implemented** keys are fields of the core model (:mod:`dscore.config.model`) or sections registered
  by plugins (``zero_optimization``, ``fp16``, ``bf16``, ``tensorboard``, ...).
* **ignored** keys (:data:`IGNORED_KEYS`) only tune logging, debugging or performance of features
  dscore does not have; they are accepted with a warning and dropped.
* **gated** keys (:data:`GATED_KEYS`) belong to features DeepSpeed 0.19.8 removed or dscore does not
  implement. A disabled block (``{"enabled": false}``, defaults only, ``null``) is accepted with a
  warning and dropped; a block that would change training is refused with a :class:`ConfigError`
  naming the key and saying dscore does not implement it.

A DeepSpeed section normally provided by a built-in plugin (:data:`PLUGIN_SECTION_KEYS`) that no active
plugin registers (the plugin was disabled) is gated the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KeyPolicy",
    "GATED_KEYS",
    "IGNORED_KEYS",
    "PLUGIN_SECTION_KEYS",
    "MONITOR_KEYS",
    "DEEPSPEED_KEYS",
    "effect_of",
]


def _truthy(value: Any) -> bool:
    """Whether a JSON value would switch something on (``false``, ``null``, ``0``, ``""``, ``"false"``,
    ``"none"``, empty containers do not)."""
    if isinstance(value, str):
        return value.strip().lower() not in {"", "false", "none", "null", "0", "no", "off"}
    return bool(value)


def _enabled_anywhere(value: Any, path: str) -> str | None:
    """Return the dotted path of the first ``enabled`` flag that is on (searched recursively)."""
    if isinstance(value, dict):
        for key, sub in value.items():
            sub_path = f"{path}.{key}"
            if key == "enabled" and _truthy(sub):
                return sub_path
            found = _enabled_anywhere(sub, sub_path)
            if found:
                return found
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            found = _enabled_anywhere(sub, f"{path}[{index}]")
            if found:
                return found
    elif _truthy(value) and "." not in path:
        return path  # e.g. "amp": true
    return None


def _enabled_effect(value: Any, path: str) -> str | None:
    where = _enabled_anywhere(value, path)
    return f"{where} is on" if where else None


def _non_default(defaults: dict[str, Any]) -> Callable[[Any, str], str | None]:
    """Effect: any key whose value differs from DeepSpeed's default (unknown keys count as effects)."""

    def effect(value: Any, path: str) -> str | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            return f"{path} = {value!r}" if _truthy(value) else None
        for key, sub in value.items():
            if key not in defaults:
                return f"{path}.{key} is set"
            default = defaults[key]
            if sub != default and not (default in (False, None) and not _truthy(sub)):
                return f"{path}.{key} = {sub!r}"
        return None

    return effect


def _keyed_truthy(*keys: str) -> Callable[[Any, str], str | None]:
    """Effect: one of ``keys`` (or ``enabled``) is on inside the block."""

    def effect(value: Any, path: str) -> str | None:
        if not isinstance(value, dict):
            return f"{path} = {value!r}" if _truthy(value) else None
        for key in (*keys, "enabled"):
            if key in value and _truthy(value[key]):
                return f"{path}.{key} = {value[key]!r}"
        return _enabled_effect(value, path)

    return effect


def _greater_than_one(*keys: str) -> Callable[[Any, str], str | None]:
    """Effect: a parallelism degree above 1 (or an enabled flag) inside the block or as the value."""

    def above(sub: Any) -> bool:
        if isinstance(sub, bool):
            return sub
        if isinstance(sub, int | float):
            return sub > 1
        return _truthy(sub)

    def effect(value: Any, path: str) -> str | None:
        if isinstance(value, dict):
            for key in keys:
                if key in value and value[key] is not None and above(value[key]):
                    return f"{path}.{key} = {value[key]!r}"
            return _enabled_effect(value, path)
        if value is not None and above(value):
            return f"{path} = {value!r}"
        return None

    return effect


def _never(value: Any, path: str) -> str | None:
    return None


@dataclass(frozen=True)
class KeyPolicy:
    """How dscore treats a DeepSpeed key it does not implement.

    Attributes:
        feature: human name of the feature, used in messages.
        removed: True when DeepSpeed 0.19.8 itself removed the key (it refuses the key on presence).
        effect: ``effect(value, path) -> str | None``: a short reason when the value would change
            training (the key is refused), ``None`` when it has no effect (accepted, warned, dropped).
    """

    feature: str
    removed: bool
    effect: Callable[[Any, str], str | None]


#: Keys of features removed in DeepSpeed 0.19.8 or not implemented by dscore.
GATED_KEYS: dict[str, KeyPolicy] = {
    # removed by DeepSpeed 0.19.8 (its _reject_removed_config_keys)
    "amp": KeyPolicy("NVIDIA apex AMP", True, _enabled_effect),
    "elasticity": KeyPolicy("elastic training", True, _enabled_effect),
    "sparse_attention": KeyPolicy("sparse attention", True, _non_default({})),
    "compression_training": KeyPolicy("compression training", True, _enabled_effect),
    "curriculum_learning": KeyPolicy("legacy curriculum learning", True, _enabled_effect),
    "progressive_layer_drop": KeyPolicy("progressive layer drop", True, _enabled_effect),
    "eigenvalue": KeyPolicy("eigenvalue computation", True, _enabled_effect),
    "quantize_training": KeyPolicy("quantize training (MoQ)", True, _enabled_effect),
    "nebula": KeyPolicy("Nebula checkpointing", True, _enabled_effect),
    "sparse_gradients": KeyPolicy("sparse gradients", True, _enabled_effect),
    "graph_harvesting": KeyPolicy("graph harvesting", True, _enabled_effect),
    # DeepSpeed features dscore does not implement (yet)
    "autotuning": KeyPolicy("autotuning", False, _enabled_effect),
    "compile": KeyPolicy("DeepCompile", False, _keyed_truthy("deepcompile")),
    "data_efficiency": KeyPolicy("data efficiency (curriculum, random-LTD)", False, _enabled_effect),
    "weight_quantization": KeyPolicy("weight quantization", False, _non_default({})),
    "use_data_before_expert_parallelism": KeyPolicy("expert-parallel data ordering", False, _keyed_truthy()),
}

#: Keys DeepSpeed reads that only tune logging, debugging or performance of features dscore lacks.
IGNORED_KEYS: dict[str, str] = {
    # validated by the engine plugin's "pipeline" section when that plugin is active
    "pipeline": "pipeline-parallel settings; the engine plugin that validates them is disabled",
    # validated by the ops plugin's "aio" section when that plugin is active (dscore.config.aio)
    "aio": "async_io op tuning; the ops plugin that validates it (and runs NVMe offload) is disabled",
    "timers": "DeepSpeed's throughput timer settings",
    "seq_parallel_communication_data_type": "dscore's Ulysses all-to-all runs in the activations' dtype",
    "disable_allgather": "a legacy DeepSpeed switch with no effect on dscore's ZeRO",
    "dump_state": "a DeepSpeed debugging printout",
    "disable_python_gc": "DeepSpeed's garbage-collection tuning",
    "memory_breakdown": "DeepSpeed's memory logging",
    "vocabulary_size": "DeepSpeed only warned when it was not a multiple of 8",
    "log_level": "use Python logging for the dscore loggers",
    "allgather_size": "it is read only with the legacy boolean form of zero_optimization",
    "data_parallel_size": "the data-parallel world size comes from the launched processes",
}

#: DeepSpeed sections dscore's built-in plugins provide, with the feature each gates when unowned.
PLUGIN_SECTION_KEYS: dict[str, KeyPolicy] = {
    "zero_optimization": KeyPolicy("ZeRO", False, _greater_than_one()),
    "hybrid_engine": KeyPolicy("the hybrid (RLHF) engine", False, _enabled_effect),
    "fp16": KeyPolicy("fp16 mixed precision", False, _enabled_effect),
    "bf16": KeyPolicy("bf16 mixed precision", False, _enabled_effect),
    "bfloat16": KeyPolicy("bf16 mixed precision", False, _enabled_effect),
    "torch_autocast": KeyPolicy("torch autocast", False, _enabled_effect),
    "tensorboard": KeyPolicy("the TensorBoard monitor", False, _enabled_effect),
    "csv_monitor": KeyPolicy("the CSV monitor", False, _enabled_effect),
    "wandb": KeyPolicy("the Weights & Biases monitor", False, _enabled_effect),
    "comet": KeyPolicy("the Comet monitor", False, _enabled_effect),
    "comms_logger": KeyPolicy("the communication logger", False, _enabled_effect),
    "flops_profiler": KeyPolicy("the flops profiler", False, _enabled_effect),
    "tensor_parallel": KeyPolicy("AutoTP tensor parallelism", False, _greater_than_one("autotp_size")),
    "expert_parallel": KeyPolicy("AutoEP expert parallelism", False, _enabled_effect),
    "activation_checkpointing": KeyPolicy(
        "activation checkpointing settings",
        False,
        _non_default(
            {
                "partition_activations": False,
                "contiguous_memory_optimization": False,
                "cpu_checkpointing": False,
                "number_checkpoints": None,
                "synchronize_checkpoint_boundary": False,
                "profile": False,
            }
        ),
    ),
}

#: Sections that configure a monitor: enabling one needs a registered MonitorSpec with that config_key.
MONITOR_KEYS: frozenset[str] = frozenset({"tensorboard", "csv_monitor", "wandb", "comet"})

#: Every top-level key DeepSpeed 0.19.8 reads or explicitly rejects (the core fields are added by
#: :mod:`dscore.config.model`).
DEEPSPEED_KEYS: frozenset[str] = frozenset(GATED_KEYS) | frozenset(IGNORED_KEYS) | frozenset(PLUGIN_SECTION_KEYS)


def effect_of(policy: KeyPolicy, key: str, value: Any) -> str | None:
    """Apply ``policy.effect`` to the value of top-level ``key``; never raises on odd JSON values."""
    zero_stage_like = key == "zero_optimization"
    if zero_stage_like:
        if isinstance(value, dict):
            stage = value.get("stage", 0)
            if stage in (0, None, False):
                return None
            return f"zero_optimization.stage = {stage!r}"
        if isinstance(value, bool):
            return "zero_optimization = true" if value else None
    return policy.effect(value, key)
