"""ZeRO stage 3's parameter coordinator: just-in-time gathers, prefetch, release, from module hooks.

A forward pre-hook gathers the module's units (waiting for a prefetch when one is in flight) and
prefetches the next units of the recorded forward order, up to ``stage3_prefetch_bucket_size`` elements,
never beyond ``stage3_max_live_parameters`` gathered elements. After forward, a unit is kept gathered for
backward only if its next use is within ``stage3_max_reuse_distance`` elements of other fetches, otherwise
released; a hook on the module's outputs re-gathers it (and prefetches the preceding units) just before
its backward. Persistent units are never released. The order is traced on the first forward
(construction order before). Training gathers are the approximate kind (``FlatUnit.gather(exact=False)``):
ZeRO++ quantized weights when the unit's gather strategy has them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from dscore.errors import DistributedError
from dscore.runtime.timers import active_timers, clock
from dscore.zero.reducer import ReduceBucket
from dscore_plugins.zero.divergence import DivergenceCheck
from dscore_plugins.zero.units import UnitBucket, UnitState

__all__ = ["Coordinator", "ModuleHook"]



def _no_hook(*args: Any) -> None:
    """What a deep copy of a stage-3 module hook becomes (see :class:`ModuleHook`)."""
    return None


class ModuleHook:
    """A stage-3 forward (pre-)hook on a user module.

    ``copy.deepcopy(model)`` (e.g. inside ``GatheredParameters``, to make a reference or EMA model) copies
    the modules' hook dicts; a bound method there would deep-copy the whole stage, its comm and process
    group (``TypeError: cannot pickle 'module' object``). The copy instead gets a no-op hook: it is a plain
    module holding the values it was copied with, not managed by the engine.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    @torch.compiler.disable
    def __call__(self, *args: Any) -> Any:
        # gather/release run eagerly under torch.compile: the user's graph breaks at each unit's hooks
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _no_hook


class Coordinator(DivergenceCheck):
    """Part of :class:`~dscore_plugins.zero.stage3.Stage3`: the gathering policy and the module hooks.

    The stage sets the attributes annotated here and calls :meth:`_reset_coordinator` after building its
    units (before registering :meth:`_pre_forward` / :meth:`_post_forward` / :meth:`_root_post_forward`).
    """

    max_live: int
    max_reuse: int
    prefetch_bucket: int
    _pswap: Any

    def _reset_coordinator(self) -> None:
        # trace (forward order of modules); construction order until the first forward is seen
        self._trace: list[torch.nn.Module] = list(self.module_units)
        self._recording: list[torch.nn.Module] | None = []
        self._trace_pos = {m: i for i, m in enumerate(self._trace)}
        self._gathered: OrderedDict[int, UnitState] = OrderedDict()  # non-persistent, LRU order
        self._in_use: set[int] = set()
        self._may_evict = sum(s.unit.numel for s in self.units if not s.unit.persistent) > self.max_live
        self._generation_depth = 0  # > 0 inside generation_context(): the hooks below do nothing

    # ------------------------------------------------------------------ generation
    @contextmanager
    def generation_context(self) -> Iterator[None]:
        """Every unit gathered once (exact values, all gathers in flight together), hooks idle, released on
        exit (units the coordinator already held stay as they were). Re-entrant: an inner use costs nothing."""
        if self._generation_depth:
            self._generation_depth += 1
            try:
                yield
            finally:
                self._generation_depth -= 1
            return
        fetched = [s for s in self.units if not s.unit.persistent and not s.unit.gathered]
        for s in fetched:
            s.unit.gather(async_op=True, exact=True)
        for s in self.units:
            s.unit.wait()
        self._generation_depth = 1
        try:
            yield
        finally:
            self._generation_depth = 0
            for s in fetched:
                if id(s.unit) not in self._gathered:
                    s.unit.release()

    # ------------------------------------------------------------------ gathering policy
    def _fetch(self, s: UnitState, *, async_op: bool = False) -> None:
        u = s.unit
        if u.persistent:
            if not async_op:
                u.wait()
            return
        if not u.gathered:
            self._make_room(u.numel)
            self._note_collective(s.index, 0)
            u.gather(async_op=async_op, exact=False)  # training gathers: ZeRO++ quantized when enabled
        elif not async_op:
            u.wait()
        self._gathered[id(u)] = s
        self._gathered.move_to_end(id(u))

    def _live(self) -> int:
        return sum(s.unit.numel for s in self._gathered.values())

    def _make_room(self, numel: int) -> None:
        live = self._live()
        if live + numel <= self.max_live:
            return
        for key in list(self._gathered):
            if live + numel <= self.max_live:
                break
            s = self._gathered[key]
            if key in self._in_use:
                continue
            self._release(s)
            live -= s.unit.numel

    def _release(self, s: UnitState) -> None:
        # a unit a GatheredParameters context holds stays gathered (and tracked) until that context ends
        if s.unit.persistent or s.unit.holds:
            return
        s.unit.release()
        self._gathered.pop(id(s.unit), None)

    def _prefetch(self, mod: torch.nn.Module, direction: int) -> None:
        pos = self._trace_pos.get(mod)
        if pos is not None and self._pswap is not None:  # start NVMe reads of the next units (buffer_count)
            order = self._trace[pos + 1 :] if direction > 0 else self._trace[pos - 1 :: -1] if pos > 0 else []
            self._pswap.prefetch(s.unit for m in order for s in self.module_units.get(m, []) if not s.unit.gathered)
        if pos is None or self.prefetch_bucket <= 0:
            return
        budget = self.prefetch_bucket
        live = self._live()
        i = pos + direction
        while 0 <= i < len(self._trace):
            for s in self.module_units.get(self._trace[i], []):
                u = s.unit
                if u.persistent or u.gathered:
                    continue
                if u.numel > budget or live + u.numel > self.max_live:
                    return
                budget -= u.numel
                live += u.numel
                self._fetch(s, async_op=True)
            i += direction

    def _reuse_distance(self, mod: torch.nn.Module) -> int:
        """Elements fetched between this module's forward and its backward (rest of forward, twice)."""
        pos = self._trace_pos.get(mod)
        if pos is None:
            return 0
        after = sum(s.unit.numel for m in self._trace[pos + 1 :] for s in self.module_units.get(m, []))
        return 2 * after

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, mod: torch.nn.Module, args: Any) -> None:
        if self._generation_depth:
            return
        units = self.module_units[mod]
        if self._recording is not None and torch.is_grad_enabled():
            self._recording.append(mod)
        for s in units:
            self._in_use.add(id(s.unit))
            s.unit.active_sub_modules.add(id(mod))  # the parameters' ds_active_sub_modules
        timers = active_timers()
        t0 = clock(timers)
        self._gather_units(units, mod, +1, mod)
        if timers is not None:
            timers.add("forward.allgather_wait", clock(timers) - t0)

    def _post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        if self._generation_depth:
            return
        units = self.module_units[mod]
        for s in units:
            self._in_use.discard(id(s.unit))
            s.unit.active_sub_modules.discard(id(mod))
        grad = torch.is_grad_enabled()
        keep = grad and self._reuse_distance(mod) <= self.max_reuse
        # a unit kept for backward needs no re-gather unless max_live_parameters may evict it
        if grad and (not keep or self._may_evict):
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _g, m=mod: self._pre_backward(m), mode="any"
                )
        if not keep:
            for s in units:
                self._release(s)

    def _root_post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and not self._generation_depth:
            self._check_same_collectives()

    def _pre_backward(self, mod: torch.nn.Module) -> None:
        units = self.module_units[mod]
        for s in units:
            if s.trainable:
                self._in_use.add(id(s.unit))
        self._gather_units(units, mod, -1, mod)

    def _gather_units(self, units: list[UnitState], anchor: torch.nn.Module, direction: int,
                      named: torch.nn.Module) -> None:
        """Launch the gathers of ``units`` and the prefetch from ``anchor`` in ``direction`` (+1 forward, -1
        backward) before waiting, so all are in flight together; then wait for ``units``. A failed gather
        is re-raised naming ``named``."""
        try:
            for s in units:
                self._fetch(s, async_op=True)
            self._prefetch(anchor, direction)
            for s in units:
                s.unit.wait()
        except DistributedError as exc:
            raise self._gather_failed(named, exc) from exc

    # ------------------------------------------------------------------ compiled regions (.regions)
    # The hooks of a region's modules, run once at the region's boundary (eagerly, outside its compiled
    # forward): the same bookkeeping as _pre_forward/_post_forward/_pre_backward per member module, in
    # module order, with every gather of the region in flight together.
    _region_members: dict[torch.nn.Module, list[torch.nn.Module]]

    def _region_units(self, mods: list[torch.nn.Module]) -> list[UnitState]:
        seen: set[int] = set()
        out = []
        for m in mods:
            for s in self.module_units[m]:
                if id(s) not in seen:
                    seen.add(id(s))
                    out.append(s)
        return out

    def _region_pre_forward(self, region: torch.nn.Module, args: Any) -> None:
        if self._generation_depth:
            return
        mods = self._region_members[region]
        if self._recording is not None and torch.is_grad_enabled():
            self._recording.extend(mods)
        for m in mods:
            for s in self.module_units[m]:
                self._in_use.add(id(s.unit))
                s.unit.active_sub_modules.add(id(m))
        timers = active_timers()
        t0 = clock(timers)
        self._gather_units(self._region_units(mods), mods[-1], +1, region)
        if timers is not None:
            timers.add("forward.allgather_wait", clock(timers) - t0)

    def _region_post_forward(self, region: torch.nn.Module, args: Any, output: Any) -> None:
        if self._generation_depth:
            return
        grad = torch.is_grad_enabled()
        regather: list[torch.nn.Module] = []
        release: list[UnitState] = []
        for m in self._region_members[region]:
            units = self.module_units[m]
            for s in units:
                self._in_use.discard(id(s.unit))
                s.unit.active_sub_modules.discard(id(m))
            keep = grad and self._reuse_distance(m) <= self.max_reuse
            if grad and (not keep or self._may_evict):
                regather.append(m)
            if not keep:
                release.extend(s for s in units if all(s is not r for r in release))
        if regather:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:  # the region's compiled backward needs every member's parameters at once
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _g, ms=tuple(regather): self._pre_backward_many(ms), mode="any"
                )
        for s in release:
            self._release(s)

    def _pre_backward_many(self, mods: tuple[torch.nn.Module, ...]) -> None:
        units = self._region_units(list(mods))
        for s in units:
            if s.trainable:
                self._in_use.add(id(s.unit))
        self._gather_units(units, mods[0], -1, mods[0])

    def _gather_failed(self, mod: torch.nn.Module, exc: DistributedError) -> DistributedError:
        """A gather whose peers posted another collective (different sizes): most often ranks running
        different modules; say which module this rank was entering and how to make its block a leaf."""
        return DistributedError(
            f"{exc} [ZeRO stage 3 was gathering the parameters of {self.module_names.get(mod, '?')!r} "
            f"({type(mod).__name__}); if the ranks run different modules (e.g. experts of a mixture-of-experts "
            "block), flag the block as a ZeRO-3 leaf before dscore.initialize: zero_optimization.leaf_module "
            '{"classes": [...]} or dscore.zero.set_z3_leaf_modules(model, [BlockClass])]'
        )

    def _reduce_launched(self, b: ReduceBucket) -> None:
        assert isinstance(b, UnitBucket)
        self._note_collective(b.state.index, 1)
        self._in_use.discard(id(b.state.unit))
        self._release(b.state)
