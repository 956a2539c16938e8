"""Write the list of DeepSpeed's config keys (each block, each field) that ``dscore.config.audit`` checks.

Run it with a Python that has the DeepSpeed release to audit against installed (not dscore's venv)::

    /work/venv-ds/bin/python tools/dump_deepspeed_keys.py dscore/config/deepspeed_keys.json

(DeepSpeed logs to stdout when imported, hence an output path.)

Sources, all read from the installed package (facts, not code): the pydantic config models DeepSpeed
validates blocks with (``DeepSpeedZeroConfig`` and the offload/leaf-module models, the fp16/bf16,
monitor, comms-logger, compile, tensor-parallel, hybrid-engine and timer models), the key constants of
the blocks it reads as plain dicts (``activation_checkpointing``, ``flops_profiler``, ``aio``,
``pipeline``, ``checkpoint``, ``data_types``), and the top-level key constants of
``deepspeed.runtime.constants``. Blocks dscore gates as a whole (``autotuning``, ``elasticity``,
``data_efficiency``, ...) are listed by their top-level key only.
"""

from __future__ import annotations

import enum
import importlib
import json
import sys
import typing
from typing import Any

MODELS = {
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
    "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    "tensorboard": "deepspeed.monitor.config:TensorBoardConfig",
    "wandb": "deepspeed.monitor.config:WandbConfig",
    "csv_monitor": "deepspeed.monitor.config:CSVConfig",
    "comet": "deepspeed.monitor.config:CometConfig",
    "comms_logger": "deepspeed.comm.config:CommsLoggerConfig",
    "compile": "deepspeed.compile.config:CompileConfig",
    "tensor_parallel": "deepspeed.runtime.tensor_parallel.config:TPTrainingConfig",
    "hybrid_engine": "deepspeed.runtime.config:HybridEngineConfig",
    "timers": "deepspeed.utils.config:DeepSpeedThroughputTimerConfig",
}

# blocks read as dicts: (module, constant-name prefix); the block's own key constant is skipped
CONSTANT_BLOCKS = {
    "activation_checkpointing": ("deepspeed.runtime.activation_checkpointing.config", "ACT_CHKPT_"),
    "flops_profiler": ("deepspeed.profiling.constants", "FLOPS_PROFILER_"),
    "aio": ("deepspeed.runtime.swap_tensor.constants", "AIO_"),
}

# blocks whose key constants share no prefix: (block path, module, constant names)
NAMED_CONSTANTS = [
    ("checkpoint", "deepspeed.runtime.constants",
     ["CHECKPOINT_TAG_VALIDATION", "LOAD_UNIVERSAL_CHECKPOINT", "USE_NODE_LOCAL_STORAGE_CHECKPOINT"]),
    ("checkpoint.parallel_write", "deepspeed.runtime.constants", ["CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE"]),
    ("data_types", "deepspeed.runtime.constants",
     ["GRAD_ACCUM_DTYPE", "PARAM_DTYPE", "BUFFER_DTYPE", "KEEP_IN_FP32_MODULES"]),
]


def _load(target: str) -> Any:
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _submodel(annotation: Any) -> Any:
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, DeepSpeedConfigModel):
            return arg
    return None


def _fields(model: Any, prefix: str, out: dict[str, dict[str, Any]]) -> None:
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}.{key}"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        default = field.get_default(call_default_factory=True)
        entry: dict[str, Any] = {}
        if extra.get("deprecated"):
            entry["deprecated"] = extra.get("new_param") or True
        sub = _submodel(field.annotation)
        if sub is not None:
            entry["block"] = True
            out[path] = entry
            _fields(sub, path, out)
            continue
        if isinstance(default, enum.Enum):
            default = default.value
        try:
            json.dumps(default)
            entry["default"] = default
        except TypeError:
            entry["default"] = repr(default)
        out[path] = entry


def _constants(module: str, prefix: str, block: str, out: dict[str, dict[str, Any]]) -> None:
    mod = importlib.import_module(module)
    for name, value in vars(mod).items():
        if not name.startswith(prefix) or name.endswith(("_DEFAULT", "_FORMAT")) or not isinstance(value, str):
            continue
        if value == block or not value.isidentifier():
            continue
        default = getattr(mod, f"{name}_DEFAULT", None)
        try:
            json.dumps(default)
        except TypeError:
            default = repr(default)
        out[f"{block}.{value}"] = {"default": default}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def main(argv: list[str]) -> int:
    import deepspeed
    from deepspeed.runtime import config as ds_config

    keys: dict[str, dict[str, Any]] = {}
    for block, target in MODELS.items():
        keys[block] = {"block": True}
        _fields(_load(target), block, keys)
    for block, (module, prefix) in CONSTANT_BLOCKS.items():
        keys[block] = {"block": True}
        _constants(module, prefix, block, keys)
    for block, module, names in NAMED_CONSTANTS:
        keys[block] = {"block": True}
        mod = importlib.import_module(module)
        for name in names:
            default = getattr(mod, f"{name}_DEFAULT", None)
            default = default.value if isinstance(default, enum.Enum) else default
            keys[f"{block}.{getattr(mod, name)}"] = {"default": default}
    # expert_parallel (AutoEP) is parsed by hand into a dataclass: its fields and defaults are the keys
    import dataclasses

    from deepspeed.module_inject.auto_ep_config import AutoEPConfig

    keys["expert_parallel"] = {"block": True}
    for f in dataclasses.fields(AutoEPConfig):
        if f.name.startswith("_"):
            continue
        default = f.default
        keys[f"expert_parallel.{f.name}"] = {"default": default if _jsonable(default) else None}
    keys["pipeline"] = {"block": True}
    for k, v in {"stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
                 "pipe_partitioned": True, "grad_partitioned": True}.items():
        keys[f"pipeline.{k}"] = {"default": v}
    # ds_config.get_pipeline_config's defaults above are checked against the installed source
    src = open(ds_config.__file__).read()
    assert all(f'"{k}"' in src for k in ("stages", "seed_layers", "pipe_partitioned")), "pipeline defaults moved"
    with open(argv[0], "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "keys": dict(sorted(keys.items()))}, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
