"""``dscore ops list [--json] [--check]`` and ``dscore ops build [NAME ...]``: the C++/CUDA ops, built ahead of time.

``list`` reads only the plugins' registrations (no torch, no compiler probe); ``list --check`` adds
each builder's ``compatibility()`` (buildable here, or why not: e.g. libaio.h missing for async_io). ``build`` compiles into
the same cache a JIT ``load()`` uses. Without names it honours DeepSpeed's install-time variables:
``DS_BUILD_OPS=1`` selects every op, ``DS_BUILD_<OP>=1``/``0`` selects or deselects one (as DeepSpeed's
``setup.py``: once any of them is set, ``DS_BUILD_OPS`` defaults to 0, so ``DS_BUILD_CPU_ADAM=1`` builds
only cpu_adam); an op selected that way but incompatible here is skipped with a warning. A
``DS_BUILD_<NAME>`` naming no registered op is reported (an error when it asks for a build, a warning when
it is 0), saying whether it is a DeepSpeed op dscore does not provide. With no names and no ``DS_BUILD_*``
variable set, every op compatible with this machine is built. An op named explicitly must build.

Exit codes: 0 all requested builds succeeded, 1 a build failed, a named op is incompatible, or a
``DS_BUILD_<NAME>=1`` names no registered op.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping

from dscore.specs import OpBuilderSpec

__all__ = ["add_arguments", "run", "select_ops", "unknown_build_variables"]

#: DS_BUILD_* variables of DeepSpeed's setup.py that name no op
_NOT_OPS = frozenset({"DS_BUILD_OPS", "DS_BUILD_STRING"})
#: every op build variable of DeepSpeed 0.19.8 (``deepspeed/ops/op_builder/*.py`` ``BUILD_VAR``), for messages
DEEPSPEED_BUILD_VARS = frozenset({
    "DS_BUILD_AIO", "DS_BUILD_CCL_COMM", "DS_BUILD_CPU_ADAGRAD", "DS_BUILD_CPU_ADAM", "DS_BUILD_CPU_LION",
    "DS_BUILD_CUTLASS_OPS", "DS_BUILD_DEEP_COMPILE", "DS_BUILD_EVOFORMER_ATTN", "DS_BUILD_FP_QUANTIZER",
    "DS_BUILD_FUSED_ADAM", "DS_BUILD_FUSED_LAMB", "DS_BUILD_FUSED_LION", "DS_BUILD_GDS",
    "DS_BUILD_INFERENCE_CORE_OPS", "DS_BUILD_PIN_MEMORY", "DS_BUILD_QUANTIZER", "DS_BUILD_RAGGED_DEVICE_OPS",
    "DS_BUILD_RAGGED_OPS", "DS_BUILD_RANDOM_LTD", "DS_BUILD_SHM_COMM", "DS_BUILD_SPATIAL_INFERENCE",
    "DS_BUILD_STOCHASTIC_TRANSFORMER", "DS_BUILD_TRANSFORMER", "DS_BUILD_TRANSFORMER_INFERENCE", "DS_BUILD_UTILS",
})  # fmt: skip

logger = logging.getLogger("dscore.ops")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``list`` (default) and ``build`` actions."""
    sub = parser.add_subparsers(dest="action")
    lst = sub.add_parser("list", help="list the registered ops", allow_abbrev=False)
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lst.add_argument("--check", action="store_true",
                     help="also probe whether each op can be built here, and why not (imports torch, runs the compiler)")
    build = sub.add_parser("build", help="build ops into the cache ahead of time", allow_abbrev=False)
    build.add_argument("names", nargs="*", metavar="NAME", help="ops to build (default: DS_BUILD_* or all compatible)")
    build.add_argument("--verbose", action="store_true", help="show the compiler commands")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def _flag(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _build_vars(env: Mapping[str, str]) -> list[str]:
    return sorted(k for k in env if k.startswith("DS_BUILD_") and k != "DS_BUILD_STRING")


def select_ops(specs: list[OpBuilderSpec], environ: Mapping[str, str] | None = None) -> list[OpBuilderSpec] | None:
    """Ops chosen by ``DS_BUILD_OPS`` / ``DS_BUILD_<OP>``; ``None`` when no ``DS_BUILD_*`` variable is set.

    ``DS_BUILD_OPS`` gives the default for every op (0 when unset) and each op's own variable overrides
    it (``"1"``/``"true"`` on, anything else off). A variable naming no registered op still switches to
    selection (see :func:`unknown_build_variables`), so ``DS_BUILD_QUANTIZER=1`` never builds every op.
    """
    env = os.environ if environ is None else environ
    if not _build_vars(env):
        return None
    default = _flag(env.get("DS_BUILD_OPS", "0"))
    return [s for s in specs if (_flag(env[s.build_env_var]) if s.build_env_var in env else default)]


def unknown_build_variables(
    specs: list[OpBuilderSpec], environ: Mapping[str, str] | None = None
) -> list[tuple[str, bool, str]]:
    """``(variable, asks_for_a_build, message)`` for each ``DS_BUILD_<NAME>`` naming no registered op."""
    env = os.environ if environ is None else environ
    known = {s.build_env_var: s.name for s in specs}
    ours = ", ".join(f"{s.name} ({s.build_env_var})" for s in specs) or "(none registered)"
    out = []
    for var in _build_vars(env):
        if var in known or var in _NOT_OPS:
            continue
        op = var[len("DS_BUILD_") :].lower()
        kind = (
            f"DeepSpeed's {op!r} op, which dscore does not provide"
            if var in DEEPSPEED_BUILD_VARS
            else "no op of dscore or DeepSpeed 0.19.8 (a typo?)"
        )
        out.append((var, _flag(env[var]), f"{var}={env[var]}: {kind}; dscore's ops: {ours}"))
    return out


def _registry():  # type: ignore[no-untyped-def]
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    return Registry(create_plugin_manager())


def run(args: argparse.Namespace) -> int:
    """Run ``list`` or ``build``; see the module docstring for exit codes."""
    registry = _registry()
    specs = [s for s in registry.specs("op_builder") if isinstance(s, OpBuilderSpec)]
    if args.action == "build":
        return _build(registry, specs, list(args.names), verbose=args.verbose)
    rows = [
        {
            "name": s.name,
            "device_types": list(s.device_types),
            "build_env_var": s.build_env_var,
            "plugin": registry.provider(s).name,
            "description": s.description,
        }
        for s in specs
    ]
    if getattr(args, "check", False):
        for row in rows:
            row["compatible"], row["reason"] = _compatibility(registry, row["name"])
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    print(f"{'op'.ljust(width)}  {'devices'.ljust(8)}  {'build variable'.ljust(22)}  description")
    for r in rows:
        devices = ",".join(r["device_types"])
        print(f"{r['name'].ljust(width)}  {devices.ljust(8)}  {r['build_env_var'].ljust(22)}  {r['description']}")
        if "compatible" in r:
            print(f"{''.ljust(width)}  {'buildable' if r['compatible'] else 'NOT buildable'}: {r['reason']}")
    if not rows:
        print("(no op builders are registered; is the dscore 'ops' plugin disabled?)")
    return 0


def _compatibility(registry, name: str) -> tuple[bool, str]:  # type: ignore[no-untyped-def]
    """The op builder's ``compatibility()``, with a failure to even load the builder as the reason."""
    from dscore.errors import DscoreError
    from dscore.ops import op_builder_class

    try:
        return op_builder_class(name, registry)().compatibility()
    except DscoreError as exc:
        return False, str(exc)


def _build(registry, specs: list[OpBuilderSpec], names: list[str], *, verbose: bool) -> int:  # type: ignore[no-untyped-def]
    from dscore.errors import DscoreError
    from dscore.ops import op_builder_class

    explicit = bool(names)
    env_failures = 0
    if explicit:
        chosen = [registry.get_typed(OpBuilderSpec, n, config_path="dscore ops build") for n in names]
    else:
        selected = select_ops(specs)
        chosen = specs if selected is None else selected
        strict_env = selected is not None
        for _var, wanted, message in unknown_build_variables(specs):
            print(f"{'FAILED  ' if wanted else 'warning '} {message}")
            env_failures += int(wanted)
        if not chosen:
            print("no ops selected (DS_BUILD_OPS / DS_BUILD_<OP> select none)")
            return 1 if env_failures else 0
    from tqdm import tqdm

    failures = env_failures
    # a progress bar over the ops on a terminal (stderr); the per-op result lines go to stdout above it
    bar = tqdm(chosen, desc="building ops", unit="op", disable=not sys.stderr.isatty(), leave=False)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        try:
            builder = op_builder_class(spec.name, registry)()
            ok, reason = builder.compatibility()
        except DscoreError as exc:
            ok, reason = False, str(exc)
        if not ok:
            if explicit:
                tqdm.write(f"FAILED   {spec.name}: not compatible here: {reason}")
                failures += 1
            else:
                why = f"selected by DS_BUILD_OPS/{spec.build_env_var}, but " if strict_env else ""
                tqdm.write(f"skipped  {spec.name}: {why}not compatible here: {reason}")
            continue
        start = time.perf_counter()
        try:
            builder.load(verbose=verbose)
            library = builder.cached_build()
        except DscoreError as exc:
            tqdm.write(f"FAILED   {spec.name}: {exc}")
            failures += 1
            continue
        where = library if library is not None else spec.name
        tqdm.write(f"built    {spec.name} ({time.perf_counter() - start:.1f} s) -> {where}")
    return 1 if failures else 0
