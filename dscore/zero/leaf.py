"""ZeRO-3 leaf modules: modules whose whole subtree stage 3 gathers at once, on entry to the module.

Stage 3 gathers a module's parameters from that module's forward hook, so every rank must run the same
modules in the same order. A block whose submodules run or not depending on the data (a mixture-of-experts
block skipping experts that received no token) breaks that; flagging the block as a *leaf* makes stage 3
gather all of its parameters when the block is entered, put no hooks on its submodules, and reduce the
block's gradients in a fixed order (zeros for what a rank did not use).

Names and semantics are DeepSpeed 0.19.8's (``deepspeed.utils.set_z3_leaf_modules`` and friends,
``zero_optimization.leaf_module``): the flag is the module attribute ``_z3_leaf``; classes match by type,
by class name or by ``module.qualname`` of the class.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

log = logging.getLogger("dscore.zero")

#: DeepSpeed 0.19.8's default ``zero_optimization.leaf_module.classes``: the sparse MoE blocks of
#: transformers' Mixtral, Qwen2-MoE and Qwen3-MoE.
DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when ``model`` is flagged as a ZeRO-3 leaf (see :func:`set_z3_leaf_modules`)."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """True when ``param`` belongs to a leaf module of a running ZeRO-3 engine (the stage sets
    ``param.ds_z3_leaf_module`` to the leaf, as DeepSpeed does)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of ``model`` (itself included) flagged as a leaf, in ``model.modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module: torch.nn.Module, entry: type | str) -> bool:
    if isinstance(entry, type):
        return isinstance(module, entry)
    cls = type(module)
    return entry in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(
    model: torch.nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[torch.nn.Module]:
    bad = [c for c in classes if not isinstance(c, type | str)]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    found: list[torch.nn.Module] = []
    for m in model.modules():
        if any(_class_matches(m, c) for c in classes):
            m._z3_leaf = flag  # type: ignore[assignment]
            found.append(m)
    if not found and raise_if_not_found:
        raise ValueError(f"no module of class {list(classes)!r} in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every module of ``model`` whose class is in ``leaf_module_classes`` as a ZeRO-3 leaf.

    A leaf's parameters (its whole subtree) are gathered together when the leaf's forward starts; its
    submodules get no hooks, so they may run in any order or not at all on a rank (mixture-of-experts
    blocks). Call before ``dscore.initialize`` (the stage reads the flags when it is built).

    Args:
        model: the model.
        leaf_module_classes: classes, class names (``"MixtralSparseMoeBlock"``) or qualified names
            (``"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"``).
        raise_if_not_found: raise when nothing matched.

    Returns:
        the flagged modules, in ``model.modules()`` order.

    Raises:
        TypeError: an entry is neither a class nor a string.
        ValueError: nothing matched and ``raise_if_not_found``.
    """
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Clear the leaf flag set by :func:`set_z3_leaf_modules` (same arguments, returns and errors)."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf flag of the modules named exactly as in ``model.named_modules()``.

    Returns:
        ``(matched modules, names that matched nothing)``.

    Raises:
        ValueError: a name matched nothing and ``raise_if_not_found``.
    """
    by_name = dict(model.named_modules())
    found: list[torch.nn.Module] = []
    missing: list[str] = []
    for name in module_names:
        m = by_name.get(name)
        if m is None:
            missing.append(name)
            continue
        m._z3_leaf = flag  # type: ignore[assignment]
        found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing!r} in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf flag of every module whose ``named_modules()`` name ends with one of the suffixes.

    Returns:
        ``(matched modules without duplicates, suffixes that matched nothing)``.

    Raises:
        ValueError: a suffix matched nothing and ``raise_if_not_found``.
    """
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    missing: list[str] = []
    named = list(model.named_modules())
    for suffix in module_name_suffixes:
        hit = False
        for name, m in named:
            if name.endswith(suffix):
                m._z3_leaf = flag  # type: ignore[assignment]
                hit = True
                if id(m) not in seen:
                    seen.add(id(m))
                    found.append(m)
        if not hit:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing!r} in model {type(model).__name__}")
    return found, missing


def apply_leaf_module_config(model: torch.nn.Module, section: Any, *, path: str = "zero_optimization.leaf_module") -> list[torch.nn.Module]:
    """Flag the leaves ``zero_optimization.leaf_module`` names (``classes``, ``names``, ``name_suffixes``).

    As DeepSpeed: entries that match nothing are not an error (one config serves several models), but
    each user-given entry that matched nothing is logged as a warning naming its key path (DeepSpeed's
    default class list is not reported).

    Returns:
        the flagged modules (without duplicates).
    """
    out: list[torch.nn.Module] = []
    seen: set[int] = set()

    def add(ms: list[torch.nn.Module]) -> None:
        for m in ms:
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)

    unmatched: list[str] = []
    for i, cls_name in enumerate(section.classes):
        ms = _set_by_class(model, [cls_name], True, raise_if_not_found=False)
        add(ms)
        if not ms and cls_name not in DEFAULT_LEAF_MODULE_CLASSES:
            unmatched.append(f"{path}.classes[{i}] = {cls_name!r}")
    ms, missing = set_z3_leaf_modules_by_name(model, section.names, raise_if_not_found=False)
    add(ms)
    unmatched += [f"{path}.names[{section.names.index(n)}] = {n!r}" for n in missing]
    ms, missing = set_z3_leaf_modules_by_suffix(model, section.name_suffixes, raise_if_not_found=False)
    add(ms)
    unmatched += [f"{path}.name_suffixes[{section.name_suffixes.index(s)}] = {s!r}" for s in missing]
    for entry in unmatched:
        log.warning("%s matches no module of %s; it has no effect", entry, type(model).__name__)
    return out
