"""The environment report (DeepSpeed's ``ds_report``): ``dscore report [--json]`` or ``python -m dscore.env_report``.

It lists dscore/Python/torch/CUDA/compiler/ninja versions, the accelerator that would be selected and
why, and one row per registered op (compatible + reason, built in the cache or not). It never crashes:
each probe runs on its own and a failing probe becomes that item's ``error`` (the row's reason).
Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["collect_report", "format_report", "main"]

logger = logging.getLogger("dscore.env_report")

_SHM_WARN_BYTES = 512 * 1024 * 1024


def _probe(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"value": fn()}`` or ``{"value": None, "error": "<Type>: <message>"}``; never raises."""
    try:
        return {"value": fn()}
    except BaseException as exc:  # noqa: BLE001 - a report must survive anything a probe does
        if isinstance(exc, KeyboardInterrupt):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"value": None, "error": f"{type(exc).__name__}: {message}"[:500]}


def _dscore() -> dict[str, str]:
    import dscore

    return {"version": dscore.__version__, "path": os.path.dirname(dscore.__file__)}


def _torch() -> dict[str, Any]:
    import torch

    return {
        "version": torch.__version__,
        "path": os.path.dirname(torch.__file__),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cuda_available": bool(torch.cuda.is_available()),
    }


def _tool(kind: str) -> dict[str, str]:
    from dscore.ops import toolchain

    tool = {"cxx": toolchain.find_cxx, "ninja": toolchain.find_ninja, "nvcc": toolchain.find_nvcc}[kind]()
    return {"path": tool.path, "version": tool.version, "found_by": tool.origin}


def _cpu_simd() -> str:
    from dscore.ops import toolchain

    return toolchain.cpu_simd_level()


def _shm() -> dict[str, Any]:
    usage = shutil.disk_usage("/dev/shm")
    out: dict[str, Any] = {"total_bytes": usage.total}
    if usage.total < _SHM_WARN_BYTES:
        out["warning"] = "/dev/shm is smaller than 512 MiB; DataLoader workers and NCCL may fail"
    return out


def _swap() -> dict[str, Any]:
    from dscore.swap_folders import find_stale_swap_folders, swap_index_path, swap_roots

    return {"index": str(swap_index_path()), "roots": [str(p) for p in swap_roots()],
            "stale": [str(p) for p in find_stale_swap_folders()]}


def deepspeed_compat() -> dict[str, Any]:
    """What ``import deepspeed`` gives in this environment, read from installed metadata (nothing imported).

    Returns:
        ``{"active": bool, "version": str | None, "location": str | None, "detail": str}``: ``active`` is True
        when the ``deepspeed`` distribution is dscore's compatibility layer (``compat/deepspeed``, version
        ``0.19.8+dscore...``), so Hugging Face Trainer / Accelerate / TRL calls into DeepSpeed run on dscore.
    """
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    location = None if spec is None or spec.origin is None else os.path.dirname(spec.origin)
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if spec is None and version is None:
        return {"active": False, "version": None, "location": None,
                "detail": "not installed (pip install ./compat/deepspeed from the dscore repository)"}
    if version is not None and "+dscore" in version and spec is not None:
        return {"active": True, "version": version, "location": location,
                "detail": f"active: `import deepspeed` is dscore's compatibility layer {version} ({location})"}
    if spec is not None and version is None:
        return {"active": False, "version": None, "location": location,
                "detail": f"a `deepspeed` module without installed metadata at {location} (not dscore's layer)"}
    return {"active": False, "version": version, "location": location,
            "detail": f"DeepSpeed {version} is installed ({location}); dscore's compatibility layer is not"}


def _process_policies() -> list[dict[str, Any]]:
    from dscore.process import policy_states

    return policy_states()


def _registry() -> Any:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    return Registry(create_plugin_manager())


def _accelerator(registry: Any) -> dict[str, str]:
    from dscore.accelerator import select_accelerator

    # the report prints the decision and its reason itself; the selection's own INFO line would say it twice
    selection_log = logging.getLogger("dscore.accelerator")
    saved_level = selection_log.level
    selection_log.setLevel(max(logging.WARNING, selection_log.getEffectiveLevel()))
    try:
        accelerator, reason = select_accelerator(registry)
    finally:
        selection_log.setLevel(saved_level)
    name = getattr(accelerator, "name", None) or type(accelerator).__name__
    return {"name": str(name), "reason": reason}


def _ops(registry: Any) -> list[dict[str, Any]]:
    from dscore.ops import op_builder_class
    from dscore.specs import OpBuilderSpec

    rows: list[dict[str, Any]] = []
    for spec in registry.specs("op_builder"):
        assert isinstance(spec, OpBuilderSpec)
        row: dict[str, Any] = {"name": spec.name, "device_types": list(spec.device_types),
                               "build_env_var": spec.build_env_var}
        def make(name: str = spec.name) -> Any:
            return op_builder_class(name, registry)()

        builder = _probe(make)
        if "error" in builder:
            row.update(compatible=False, reason=builder["error"], built=None, built_reason=builder["error"])
            rows.append(row)
            continue
        compat = _probe(builder["value"].compatibility)
        if "error" in compat:
            row.update(compatible=False, reason=compat["error"])
        else:
            ok, reason = compat["value"]
            row.update(compatible=bool(ok), reason=str(reason))
        cached = _probe(builder["value"].cached_build) if row["compatible"] else {"value": None, "error": "incompatible"}
        if "error" in cached:
            row.update(built=None, built_reason=cached["error"])
        else:
            row.update(built=cached["value"] is not None, path=str(cached["value"]) if cached["value"] else None)
        rows.append(row)
    return rows


def collect_report() -> dict[str, Any]:
    """Gather every item; each is ``{"value": ...}`` or ``{"value": None, "error": "..."}``.

    Returns:
        ``{"dscore", "python", "torch", "cxx", "ninja", "nvcc", "cpu_simd", "shm", "swap", "deepspeed_compat",
        "process_policies", "accelerator", "ops"}`` (``deepspeed_compat``: see :func:`deepspeed_compat`;
        ``process_policies``: one row per process-wide policy with its state and why, see
        :func:`dscore.process.policy_states`)
        (``swap``: ``{"index", "roots", "stale"}``, NVMe-offload swap folders left by killed runs, see
        :mod:`dscore.swap_folders`);
        ``ops`` holds a list of rows ``{name, device_types, build_env_var, compatible, reason, built, ...}``.
    """
    report: dict[str, Any] = {
        "dscore": _probe(_dscore),
        "python": {"value": {"version": sys.version.split()[0], "executable": sys.executable}},
        "torch": _probe(_torch),
        "cxx": _probe(lambda: _tool("cxx")),
        "ninja": _probe(lambda: _tool("ninja")),
        "nvcc": _probe(lambda: _tool("nvcc")),
        "cpu_simd": _probe(_cpu_simd),
        "shm": _probe(_shm),
        "swap": _probe(_swap),
        "deepspeed_compat": _probe(deepspeed_compat),
        "process_policies": _probe(_process_policies),
    }
    registry = _probe(_registry)
    if "error" in registry:
        report["accelerator"] = {"value": None, "error": registry["error"]}
        report["ops"] = {"value": None, "error": registry["error"]}
    else:
        report["accelerator"] = _probe(lambda: _accelerator(registry["value"]))
        report["ops"] = _probe(lambda: _ops(registry["value"]))
    return report


def _show(item: dict[str, Any], fmt: Callable[[Any], str]) -> str:
    if "error" in item:
        return f"[unavailable] {item['error']}"
    try:
        return fmt(item["value"])
    except Exception as exc:  # noqa: BLE001
        return f"[unavailable] {type(exc).__name__}: {exc}"


def format_report(report: dict[str, Any]) -> str:
    """Human-readable text of :func:`collect_report`'s result."""
    lines = ["dscore environment report", "-" * 60]

    def row(label: str, text: str) -> None:
        lines.append(f"{label} {'.' * max(2, 28 - len(label))} {text}")

    row("dscore", _show(report["dscore"], lambda v: f"{v['version']} ({v['path']})"))
    row("python", _show(report["python"], lambda v: f"{v['version']} ({v['executable']})"))
    row("torch", _show(report["torch"], lambda v: f"{v['version']} ({v['path']})"))
    row("torch cuda / hip", _show(report["torch"], lambda v: f"{v['cuda']} / {v['hip']}, device available: {v['cuda_available']}"))
    for key, label in (("cxx", "C++ compiler"), ("ninja", "ninja"), ("nvcc", "nvcc")):
        row(label, _show(report[key], lambda v: f"{v['version']} ({v['path']}, via {v['found_by']})"))
    row("cpu simd", _show(report["cpu_simd"], str))
    row("/dev/shm", _show(report["shm"], lambda v: f"{v['total_bytes'] / 2**30:.1f} GiB" + (f"  WARNING: {v['warning']}" if "warning" in v else "")))
    row("nvme swap folders", _show(report["swap"], lambda v: (
        f"{len(v['stale'])} stale (left by killed runs; safe to delete)" if v["stale"] else "no stale ones"
    ) + f" under {len(v['roots'])} nvme_path(s) listed in {v['index']}"))
    for path in (report["swap"].get("value") or {}).get("stale", []):
        lines.append(f"{'':30}stale: {path}")
    if "deepspeed_compat" in report:
        row("deepspeed (compat)", _show(report["deepspeed_compat"], lambda v: str(v["detail"])))
    row("accelerator", _show(report["accelerator"], lambda v: f"{v['name']} ({v['reason'].split('; skipped ')[0]})"))
    accelerator = report["accelerator"].get("value") or {}
    if "; skipped " in str(accelerator.get("reason", "")):
        # one line per accelerator that is not usable here, under the chosen one
        for item in re.split(r"; (?=[\w.-]+: )", str(accelerator["reason"]).split("; skipped ", 1)[1]):
            lines.append(f"{'':30}not usable: {item}")
    if "process_policies" in report:
        lines += ["", "process policies (DSCORE_PROCESS_POLICIES=all|none|a,b; docs/environment-variables.md)",
                  "-" * 60]
        policies = report["process_policies"]
        if "error" in policies:
            lines.append(f"[unavailable] {policies['error']}")
        else:
            width = max([len(r["name"]) for r in policies["value"]] + [6])
            for r in policies["value"]:
                lines.append(f"{r['name'].ljust(width)}  {('[ON]' if r['on'] else '[OFF]').ljust(5)}  {r['why']}")
    lines += ["", "ops (JIT-built with ninja on first use; `dscore ops build` builds ahead)", "-" * 60]
    ops = report["ops"]
    if "error" in ops:
        lines.append(f"[unavailable] {ops['error']}")
        return "\n".join(lines)
    width = max([len(r["name"]) for r in ops["value"]] + [7])
    lines.append(f"{'op'.ljust(width)}  {'compatible'.ljust(10)}  {'built'.ljust(7)}  reason")
    for r in ops["value"]:
        built = "?" if r.get("built") is None else ("yes" if r["built"] else "no")
        lines.append(f"{r['name'].ljust(width)}  {('[OKAY]' if r['compatible'] else '[NO]').ljust(10)}  {built.ljust(7)}  {r['reason']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the machine-readable report."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the report; always exits 0 (failures are shown per item)."""
    report = collect_report()
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dscore.env_report [--json]``."""
    parser = argparse.ArgumentParser(prog="python -m dscore.env_report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="[dscore] %(levelname)s %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
