"""``dscore checkpoint``: inspect and export checkpoints written by ``engine.save_checkpoint``.

* ``dscore checkpoint export CKPT_DIR [--tag T] OUT [--dtype fp32|bf16|fp16]``: one consolidated
  safetensors file of the full model (fp32 master weights when the run kept them), without a process
  group: DeepSpeed's ``zero_to_fp32.py`` job. ``OUT`` is a file path, or a directory that then receives
  ``model.safetensors``.
* ``dscore checkpoint list CKPT_DIR [--json]``: the tags, whether each is complete, which one ``latest``
  names, world size, ZeRO stage, step and size in bytes.

Torch is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sub-actions ``export`` and ``list``."""
    sub = parser.add_subparsers(dest="action", required=True)
    exp = sub.add_parser(
        "export",
        help="write one consolidated safetensors file of the model (no process group needed)",
        allow_abbrev=False,
    )
    exp.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="the directory given to save_checkpoint")
    exp.add_argument("output", metavar="OUT", help="output .safetensors file (or a directory for model.safetensors)")
    exp.add_argument("--tag", "-t", default=None, help="tag to export (default: the one named by CKPT_DIR/latest)")
    exp.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of floating-point tensors (default fp32)",
    )
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
    if args.action == "export":
        from dscore.checkpoint.export import convert_checkpoint

        path = convert_checkpoint(args.checkpoint_dir, args.output, tag=args.tag, dtype=args.dtype)
        print(path)
        return 0
    from dscore.checkpoint.export import describe_checkpoints

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
