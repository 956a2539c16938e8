"""``dscore config check FILE [--world-size N] [--json] [--lenient]``: validate a ds_config.

Prints the resolved values (the batch triangle for the given number of processes, ZeRO stage,
precision, optimizer, scheduler, offload devices) and every warning. Exit codes: 0 valid, 2 invalid
(with ``--json``: ``{"error": {"type", "path", "message"}}`` on stdout; never a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig

__all__ = ["add_arguments", "run", "summary"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check`` action and its options to ``parser``."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate a ds_config and print the resolved values",
        description="Validate a ds_config (JSON or Hjson file, or url-safe base64) and print the resolved values.",
        allow_abbrev=False,
    )
    check.add_argument("file", metavar="FILE", help="path to ds_config.json (JSON or Hjson), or url-safe base64 text")
    check.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of processes (default: $WORLD_SIZE, else 1); the batch triangle uses the data-parallel "
        "size: this divided by tensor_parallel.autotp_size x sequence_parallel_size",
    )
    check.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    check.add_argument("--lenient", action="store_true", help='unknown keys are warnings (like "strict": false)')


def _offload_device(zero: Any, name: str) -> str | None:
    block = getattr(zero, name, None)
    return getattr(block, "device", None) if block is not None else None


def summary(cfg: DscoreConfig) -> dict[str, Any]:
    """The resolved values ``dscore config check --json`` prints (see the module docstring)."""
    from dscore.parallel.mesh import raw_mesh_degrees  # the mesh degrees (tensor_parallel is a plugin's section)

    zero = cfg.section("zero_optimization", None)
    return {
        "source": cfg.source_name,
        "world_size": cfg.world_size,
        "train_batch_size": cfg.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "zero_stage": cfg.zero_stage,
        "zero_implementation": cfg.zero_implementation,
        "fp16_enabled": cfg.fp16_enabled,
        "bf16_enabled": cfg.bf16_enabled,
        "optimizer_type": cfg.optimizer.type if cfg.optimizer is not None else None,
        "scheduler_type": cfg.scheduler.type if cfg.scheduler is not None else None,
        "gradient_clipping": cfg.gradient_clipping,
        "tensor_parallel_size": raw_mesh_degrees(cfg.raw)[0],
        "sequence_parallel_size": cfg.sequence_parallel_size,
        "offload_optimizer_device": _offload_device(zero, "offload_optimizer"),
        "offload_param_device": _offload_device(zero, "offload_param"),
        "pending_auto": cfg.pending_auto,
        "warnings": cfg.warnings,
        "config": _jsonable(cfg.model_dump(mode="json", by_alias=True)),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _world_size(args: argparse.Namespace) -> tuple[int, str]:
    if args.world_size is not None:
        return args.world_size, f"--world-size {args.world_size}"
    env = os.environ.get("WORLD_SIZE", "").strip()
    if env:
        try:
            return int(env), f"WORLD_SIZE={env} in the environment"
        except ValueError:
            from dscore.errors import ConfigError

            raise ConfigError(f"WORLD_SIZE={env!r} in the environment is not an integer; pass --world-size N") from None
    return 1, "default 1 (no --world-size, no WORLD_SIZE)"


def run(args: argparse.Namespace) -> int:
    """Validate ``args.file``; return 0 when valid, 2 when not."""
    from dscore.config import load_config
    from dscore.errors import ConfigError, DscoreError

    try:
        processes, where = _world_size(args)
        from dscore.config.loader import read_source
        from dscore.parallel.mesh import batch_world_size, raw_mesh_degrees

        raw = read_source(args.file)[0]
        # as dscore.initialize (without an mpu): DeepSpeed's world size for the triangle
        world_size, where = batch_world_size(processes, raw, source=where)
        cfg = load_config(
            args.file, world_size=world_size, strict=False if args.lenient else None, world_size_source=where
        )
    except DscoreError as exc:
        path = exc.path if isinstance(exc, ConfigError) else ""
        if args.json:
            payload: dict[str, dict[str, Any]] = {
                "error": {"type": type(exc).__name__, "path": path, "message": str(exc)}
            }
            if isinstance(exc, ConfigError) and len(exc.errors) > 1:
                payload["error"]["errors"] = [{"path": p, "message": m} for p, m in exc.errors]
            print(json.dumps(payload, indent=2))
        else:
            print(f"dscore config: error: {exc}", file=sys.stderr)
        return 2
    data = summary(cfg)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    tp, sp = raw_mesh_degrees(raw)
    line = f"{cfg.source_name} is valid for {processes} process{'' if processes == 1 else 'es'} ({_world_size_origin(args)})"
    if tp > 1 or sp > 1:
        # the triangle's world size is not the data-parallel size under tensor / sequence parallelism
        line += (f"; data-parallel size {processes // (tp * sp)} (tp {tp} x sp {sp}), batch triangle world size "
                 f"{world_size} ({where})")
    print(line + ".")
    for key, value in data.items():
        if key in {"config", "warnings", "source", "world_size", "pending_auto"}:
            continue
        print(f"  {key} = {'none' if value is None else value}")
    if cfg.pending_auto:
        print('  left as "auto" until dscore.initialize sees the model: ' + ", ".join(cfg.pending_auto))
    for message in cfg.warnings:
        print(f"  warning: {message}")
    return 0


def _world_size_origin(args: argparse.Namespace) -> str:
    """Where the world size came from, in words, for the text output's first line."""
    if args.world_size is not None:
        return "from --world-size"
    if os.environ.get("WORLD_SIZE", "").strip():
        return "from WORLD_SIZE in the environment"
    return "the default; pass --world-size N to check the batch sizes for N processes"
