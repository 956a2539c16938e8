"""``dscore checkpoint``: inspect and export checkpoints written by ``engine.save_checkpoint``.

* ``dscore checkpoint export CKPT_DIR [--tag T] OUT [--dtype fp32|bf16|fp16]``: one consolidated
  safetensors file of the full model (fp32 master weights when the run kept them), without a process
  group: DeepSpeed's ``zero_to_fp32.py`` job. ``OUT`` is a file path, or a directory that then receives
  ``model.safetensors``.
* ``dscore checkpoint export DS_DIR --fp32 OUT [--tag T]``: the same from a **DeepSpeed** save directory
  (any ZeRO stage and world size), streaming one shard at a time (``zero_to_fp32`` without DeepSpeed).
  ``--fp32 OUT`` is accepted for dscore directories too (same as ``OUT --dtype fp32``).
* ``dscore checkpoint import DS_DIR OUT_DIR [--tag T]``: convert a DeepSpeed checkpoint once into dscore's
  pickle-free format (``OUT_DIR/<tag>``, ``OUT_DIR/latest``), streaming one shard at a time; DeepSpeed's
  pickles are read with a restricted unpickler (see :mod:`dscore.checkpoint.deepspeed`). Any registered
  ``checkpoint_layout`` that declares an import converts the same way.
* ``dscore checkpoint list CKPT_DIR [--json]``: the tags, whether each is complete, which one ``latest``
  names, world size, ZeRO stage, step and size in bytes (a DeepSpeed directory: its latest tag's stage,
  world size and files).

The layout of a directory is detected through the registry (:mod:`dscore.persistence.layouts`), so a
disabled layout (``checkpoint_layout:deepspeed``) is refused naming the unit. Torch is imported only when a
command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sub-actions ``export``, ``import`` and ``list``."""
    sub = parser.add_subparsers(dest="action", required=True)
    exp = sub.add_parser(
        "export",
        help="write one consolidated safetensors file of the model (no process group needed)",
        allow_abbrev=False,
    )
    exp.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="the directory given to save_checkpoint")
    exp.add_argument(
        "output", metavar="OUT", nargs="?", default=None,
        help="output .safetensors file (or a directory for model.safetensors)",
    )
    exp.add_argument("--tag", "-t", default=None, help="tag to export (default: the one named by CKPT_DIR/latest)")
    exp.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="dtype of floating-point tensors (default fp32)",
    )
    exp.add_argument(
        "--fp32", metavar="OUT", dest="fp32_output", default=None,
        help="write the fp32 consolidated weights to OUT (DeepSpeed's zero_to_fp32; also for DeepSpeed directories)",
    )
    imp = sub.add_parser(
        "import",
        help="convert a DeepSpeed checkpoint into dscore's pickle-free format (streamed, any stage/world size)",
        allow_abbrev=False,
    )
    imp.add_argument("ds_dir", metavar="DS_DIR", help="the directory given to DeepSpeed's save_checkpoint")
    imp.add_argument("out_dir", metavar="OUT_DIR", help="the dscore save directory to write (OUT_DIR/<tag>, OUT_DIR/latest)")
    imp.add_argument("--tag", "-t", default=None, help="DeepSpeed tag to import (default: DS_DIR/latest)")
    lst = sub.add_parser("list", help="list the tags of a checkpoint directory", allow_abbrev=False)
    lst.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="the directory given to save_checkpoint")
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _size_text(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; errors surface as :class:`~dscore.errors.CheckpointError` (exit code 2)."""
    from dscore.errors import CheckpointError

    if args.action == "import":
        from dscore.persistence.export import import_checkpoint

        print(import_checkpoint(args.ds_dir, args.out_dir, tag=args.tag))
        return 0
    if args.action == "export":
        if args.fp32_output is not None and args.output is not None:
            raise CheckpointError("give the output once: either OUT or --fp32 OUT")
        if args.fp32_output is not None and args.dtype not in (None, "fp32"):
            raise CheckpointError(f"--fp32 writes fp32 weights; it cannot be combined with --dtype {args.dtype}")
        output = args.fp32_output if args.fp32_output is not None else args.output
        if output is None:
            raise CheckpointError("name the output file: `dscore checkpoint export CKPT_DIR OUT` or `--fp32 OUT`")
        from dscore.persistence.export import convert_checkpoint  # any registered layout (DeepSpeed's too)

        path = convert_checkpoint(args.checkpoint_dir, output, tag=args.tag, dtype=args.dtype or "fp32")
        print(path)
        return 0
    import os

    from dscore.exports import active_registry
    from dscore.persistence import layouts

    directory = os.path.abspath(args.checkpoint_dir)
    name, layout = layouts.layout_for_load(active_registry()[0], directory, None)
    describe = getattr(layout, "describe", None)
    if name != layouts.NATIVE and callable(describe):  # a foreign layout's own summary (DeepSpeed's)
        ds_info = describe(directory)
        if args.json:
            json.dump(ds_info, sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        fmt = getattr(layout, "format_description", None)
        print(fmt(ds_info) if callable(fmt) else json.dumps(ds_info, indent=2))
        return 0
    from dscore.persistence.export import describe_checkpoints

    info = describe_checkpoints(args.checkpoint_dir)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"{info['dir']}  (latest: {info['latest'] or '-'})")
    if not info["tags"]:
        print("  no tags")
    for t in info["tags"]:
        flags = ("latest " if t["tag"] == info["latest"] else "") + ("complete" if t["complete"] else "INCOMPLETE")
        print(
            f"  {t['tag']:<24} {flags:<16} ranks={t['world_size'] if t['world_size'] is not None else '-'} "
            f"zero={t['zero_stage'] if t['zero_stage'] is not None else '-'} "
            f"step={t['global_steps'] if t['global_steps'] is not None else '-'} {_size_text(t['bytes'])}"
        )
    return 0
