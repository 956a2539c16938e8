"""ZeRO stage 3 under ``torch.compile``: the compiled regions and the hooks at their boundaries.

Why regions. Stage 3 gathers a module's parameters in a forward pre-hook and releases them in a forward
hook: Python control flow over the coordinator's counters (prefetch order, LRU eviction under
``stage3_max_live_parameters``, reuse distance) and collectives. Inside a compiled module those hooks are
graph breaks (``torch.compiler.disable``), one per hooked module: 22 for a 2-layer Llama, DeepSpeed 0.19.8's
18-49. Here the hooks never run inside compiled code instead: ``engine.compile()`` compiles each *region*'s
``forward`` on its own, and the stage's hooks for every module inside a region run once, eagerly, at that
region's boundary (its ``nn.Module`` pre/post forward hooks, which ``_call_impl`` runs outside the compiled
``forward``). So 0 graph breaks from ZeRO, the coordinator's policy unchanged, per region instead of per
module, and the same as FSDP2's recommended use (``fully_shard`` + ``torch.compile`` per transformer block).

Which modules are regions (:func:`choose_regions`), walking down from the root over modules whose subtree
holds a hooked module (one owning stage-3 units):

* an entry of an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` (a transformer block, an MLP
  layer) is a region with its whole subtree;
* a hooked module with no hooked module below it (an embedding, a final norm, an ``lm_head``, a ZeRO-3 leaf
  module, whose submodules carry no hooks) is a region;
* any other module (the model's own ``forward`` with its masks and loops) stays eager, its own hook (when it
  has parameters of its own) fires eagerly as before, and the walk goes on into its children.

A region's parameters are gathered together (all gathers in flight at once, then the prefetch of the next
units) and each inner module keeps its own reuse-distance decision; a region larger than
``stage3_max_live_parameters`` goes over that bound for the length of its forward (its units are all in use).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["choose_regions"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def choose_regions(
    root: torch.nn.Module, hooked: Collection[torch.nn.Module]
) -> list[tuple[str, torch.nn.Module, list[torch.nn.Module]]]:
    """The compiled regions of ``root`` (see the module docstring for the rule).

    Args:
        root: the engine's module.
        hooked: the modules carrying stage-3 hooks (owning units; a ZeRO-3 leaf carries its subtree's).

    Returns:
        ``(qualified name, region, hooked modules inside it in module order)`` for each region, in module
        order; every hooked module is inside exactly one region or is an eager ancestor of regions (its
        own hook stays on it).
    """
    hooked_set = set(hooked)
    below: dict[torch.nn.Module, bool] = {}  # subtree holds a hooked module

    def holds(mod: torch.nn.Module) -> bool:
        if mod not in below:
            below[mod] = mod in hooked_set or any(holds(c) for c in mod.children())
        return below[mod]

    regions: list[tuple[str, torch.nn.Module, list[torch.nn.Module]]] = []

    def members(mod: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in mod.modules() if m in hooked_set]

    seen: set[torch.nn.Module] = set()  # a module registered under two parents is one region

    def walk(mod: torch.nn.Module, name: str, in_container: bool) -> None:
        if not holds(mod) or mod in seen:
            return
        seen.add(mod)
        if in_container or not any(holds(c) for c in mod.children()):
            regions.append((name, mod, members(mod)))
            seen.update(mod.modules())
            return
        container = isinstance(mod, _CONTAINERS)
        for child_name, child in mod.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, container)

    walk(root, "", False)
    return regions
