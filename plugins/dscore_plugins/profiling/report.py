"""The flops profiler's report: DeepSpeed 0.19.8's number formats and its printed layout.

:func:`profile_text` renders a finished profile (any :class:`Profile`, i.e. a
:class:`~dscore_plugins.profiling.profiler.FlopsProfiler` after a profiled forward) as DeepSpeed prints
it: the summary (world, batch, params, MACs, flops, latencies and FLOPS; with an engine, the backward and
step latencies of its phase timers), the aggregated profile per model depth and, ``detailed``, the
module tree annotated with each module's numbers. The ``*_to_string`` helpers are DeepSpeed's formats
(``197.63 K``, ``98.3 KMACs``, ``1.5 ms``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TextIO

from torch import nn

__all__ = [
    "DEFAULT_PRECISION",
    "Profile",
    "RootCounts",
    "aggregated_lines",
    "annotated_tree",
    "duration_to_string",
    "flops_to_string",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
    "profile_text",
    "write_text",
]

DEFAULT_PRECISION = 2


class RootCounts(Protocol):
    """The parameter counts of the profiled model's root module (a ``ModuleProfile``)."""

    params: int
    model_expert_params: int


class Profile(Protocol):
    """What the report reads of a finished profile (see :class:`~dscore_plugins.profiling.profiler.FlopsProfiler`)."""

    model: nn.Module
    ds_engine: Any
    recompute_fwd_factor: float
    engine_latencies: dict[str, float] | None

    def module_profile(self, module: nn.Module) -> RootCounts: ...

    def module_flops(self, module: nn.Module) -> int: ...

    def module_macs(self, module: nn.Module) -> int: ...

    def module_duration(self, module: nn.Module) -> float: ...

    def module_params(self, module: nn.Module) -> int: ...

    def get_total_flops(self, as_string: bool = False) -> int | str: ...

    def get_total_macs(self, as_string: bool = False) -> int | str: ...

    def get_total_duration(self, as_string: bool = False) -> float | str: ...

    def get_total_params(self, as_string: bool = False) -> int | str: ...


# --------------------------------------------------------------------------------------------- strings
def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` scaled to T/G/M/K/(none)/m/u with ``precision`` decimals, e.g. ``197.63 K`` (DeepSpeed's format)."""
    scales = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "m": 1e-3, "u": 1e-6}
    if units is None:
        for prefix, magnitude in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
            if num >= magnitude:
                units = prefix
                break
        else:
            if num >= 1 or num == 0:
                units, magnitude = "", 1.0
            elif num >= 1e-3:
                units, magnitude = "m", 1e-3
            else:
                units, magnitude = "u", 1e-6
    else:
        magnitude = scales.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``98.3 KMACs``."""
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``1.2 GFLOPS`` (per second)."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``12.45 K`` (billions as ``B``)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``1.5 ms``."""
    return f"{number_to_string(seconds, units, precision)}s"


# --------------------------------------------------------------------------------------------- report
def profile_text(
    profile: Profile, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True
) -> str:
    """The report of ``profile`` in DeepSpeed's layout (what ``print_model_profile`` writes).

    Args:
        profile: a profile with counts (its ``module_*`` / ``get_total_*`` methods raise when it has none).
        profile_step: the step named in the header.
        module_depth / top_modules: the aggregated profile's depth (-1: all) and modules per depth.
        detailed: append the annotated module tree.
    """
    total_flops = int(profile.get_total_flops())
    total_macs = int(profile.get_total_macs())
    total_duration = float(profile.get_total_duration())
    total_params = int(profile.get_total_params())
    engine = profile.ds_engine
    mp = int(getattr(engine, "mp_world_size", 1) or 1) if engine is not None else 1
    root = profile.module_profile(profile.model)
    model_nonexpert = root.params * mp if engine is not None else 0
    model_expert = root.model_expert_params if engine is not None else 0
    lines: list[str] = []
    out = lines.append
    fmt = "{:<70}  {:<8}"
    out("\n-------------------------- DeepSpeed Flops Profiler --------------------------")
    out(f"Profile Summary at step {profile_step}:")
    out(
        "Notations:\n"
        "data parallel size (dp_size), model parallel size(mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
    )
    micro_batch = 0
    if engine is not None:
        micro_batch = int(engine.train_micro_batch_size_per_gpu())
        out(fmt.format("world size: ", engine.world_size))
        out(fmt.format("data parallel size: ", engine.dp_world_size))
        out(fmt.format("model parallel size: ", mp))
        out(fmt.format("batch size per GPU: ", micro_batch))
        if model_expert:
            out(fmt.format("expert tensor parallelism enabled: ", False))
    out(fmt.format("params per GPU: ", params_to_string(total_params)))
    if model_expert > 0:
        out(fmt.format("params of model: ", params_to_string(model_nonexpert + model_expert)))
        out(fmt.format("   non-expert params of model: ", params_to_string(model_nonexpert)))
        out(fmt.format("   expert params of model: ", params_to_string(model_expert)))
    else:
        out(fmt.format("params of model = params per GPU * mp_size: ", params_to_string(model_nonexpert)))
    out(fmt.format("fwd MACs per GPU: ", macs_to_string(total_macs)))
    out(fmt.format("fwd flops per GPU: ", number_to_string(total_flops)))
    out(fmt.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total_flops * mp)))
    phases = profile.engine_latencies
    fwd = phases["forward"] if phases else total_duration
    out(fmt.format("fwd latency: ", duration_to_string(fwd)))
    out(
        fmt.format(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(_ratio(total_flops, fwd))
        )
    )
    if phases:
        factor = 2 + profile.recompute_fwd_factor
        bwd, step = phases["backward"], phases["step"]
        out(fmt.format("bwd latency: ", duration_to_string(bwd)))
        out(fmt.format(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                       flops_to_string(_ratio(factor * total_flops, bwd))))  # fmt: skip
        out(fmt.format(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                       flops_to_string(_ratio((factor + 1) * total_flops, fwd + bwd))))  # fmt: skip
        out(fmt.format("step latency: ", duration_to_string(step)))
        it = fwd + bwd + step
        out(fmt.format("iter latency: ", duration_to_string(it)))
        out(fmt.format(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                       flops_to_string(_ratio((factor + 1) * total_flops, it))))  # fmt: skip
        samples = micro_batch * int(engine.world_size) if engine is not None else 0
        out(fmt.format("samples/second: ", round(_ratio(samples, it), DEFAULT_PRECISION)))
    out("\n----------------------------- Aggregated Profile per GPU -----------------------------")
    lines.extend(aggregated_lines(profile, module_depth, top_modules))
    if detailed:
        out("\n------------------------------ Detailed Profile per GPU ------------------------------")
        out(
            "Each module profile is listed after its name in the following order: \nparams, percentage of "
            "total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, "
            "fwd FLOPS"
        )
        out(
            "\nNote: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. "
            "CrossEntropyLoss). They are not counted as submodules, thus not to be printed out. However they "
            "make up the difference between a parent's MACs (or latency) and the sum of its submodules'.\n"
            "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using "
            "that could be larger than the maximum system throughput.\n3. The fwd latency listed in the top "
            "module's profile is directly captured at the module forward function in PyTorch, thus it's less "
            "than the fwd latency shown above which is captured in DeepSpeed.\n"
        )
        out(annotated_tree(profile, total_params, total_macs, total_duration))
    out("------------------------------------------------------------------------------")
    return "\n".join(lines) + "\n"


def annotated_tree(profile: Profile, total_params: int, total_macs: int, total_duration: float) -> str:
    """``repr(profile.model)`` with each module's numbers (params, MACs, latency, FLOPS, with their shares of the
    totals) before its own ``extra_repr``; the modules' ``extra_repr`` are restored afterwards."""

    def pct(part: float, whole: float) -> float:
        return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0

    replaced: list[nn.Module] = []
    try:
        for module in profile.model.modules():
            original = module.extra_repr
            params = profile.module_params(module)
            macs = profile.module_macs(module)
            duration = profile.module_duration(module)
            flops = profile.module_flops(module)
            items = [
                f"{params_to_string(params)} = {pct(params, total_params):g}% Params",
                f"{macs_to_string(macs)} = {pct(macs, total_macs):g}% MACs",
                f"{duration_to_string(duration)} = {pct(duration, total_duration):g}% latency",
                flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0),
            ]
            own = original()
            if own:
                items.append(own)
            text = ", ".join(items)
            module.extra_repr = _constant(text)  # type: ignore[method-assign]
            replaced.append(module)
        return repr(profile.model)
    finally:
        for module in replaced:
            module.__dict__.pop("extra_repr", None)


def aggregated_lines(profile: Profile, module_depth: int, top_modules: int) -> list[str]:
    """The aggregated profile: per model depth, the ``top_modules`` module types by params, MACs and latency
    (depths ``0 .. module_depth - 1``; -1: every depth but the innermost, as DeepSpeed)."""
    info: dict[int, dict[str, list[float]]] = {}

    def walk(module: nn.Module, depth: int) -> None:
        row = info.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += profile.module_macs(module)
        row[1] += profile.module_params(module)
        row[2] += profile.module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(profile.model, 0)
    # DeepSpeed lists depths 0 .. len-2 for -1 (the innermost level is left out), and so do we.
    depth = len(info) - 1 if module_depth == -1 else module_depth
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(depth):
        rows = info.get(d, {})
        n = min(top_modules, len(rows))

        def top(index: int, to_string: Callable[[float], str], rows: dict[str, list[float]] = rows,
                n: int = n) -> dict[str, str]:  # fmt: skip
            ranked = sorted(rows.items(), key=lambda kv: kv[1][index], reverse=True)[:n]
            return {k: to_string(v[index]) for k, v in ranked}

        lines.append(f"depth {d}:")
        lines.append(f"    params      - {top(1, params_to_string)}")
        lines.append(f"    MACs        - {top(0, macs_to_string)}")
        lines.append(f"    fwd latency - {top(2, duration_to_string)}")
    return lines


def write_text(stream: TextIO, text: str) -> None:
    """Write ``text`` to ``stream`` and flush it."""
    stream.write(text)
    stream.flush()


def _constant(text: str) -> Callable[[], str]:
    return lambda: text


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0
