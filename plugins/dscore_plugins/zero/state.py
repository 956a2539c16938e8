"""ZeRO stage 3's state: optimizer-state checkpoints and full module state dicts, gathered unit by unit.

``state_dict`` / ``load_state_dict`` are the world-size-independent partitioned optimizer state
(:func:`dscore.zero.layout.partitioned_state_dict`; MoE experts under their global names, NVMe-resident
state materialized around them); ``module_state_dict`` / ``load_module_state_dict`` gather each unit in
turn (collective) to read or overwrite the full weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from dscore.comm import Comm
from dscore.moe.checkpoint import ExpertNaming
from dscore.zero.layout import load_partitioned_state, partitioned_state_dict
from dscore_plugins.zero.experts import globalize_state, localize_state
from dscore_plugins.zero.nvme_optimizer import materialized as nvme_materialized
from dscore_plugins.zero.units import Units

__all__ = ["StateIO"]


class StateIO(Units):
    """Part of :class:`~dscore_plugins.zero.stage3.Stage3`: its checkpoint and state-dict methods."""

    comm: Comm
    rank: int
    loss_scaler: Any
    has_experts: bool
    load_from_fp32_weights: bool
    _pairs: list[Any]
    _pair_comms: dict[int, Comm]
    _pair_ranks: dict[int, int]

    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed by parameter name (collective: call on every rank)."""
        with nvme_materialized(self._optimizer):
            out = partitioned_state_dict(self._optimizer, self._pairs, self.comm, self.loss_scaler, comms=self._pair_comms)
        # MoE experts under their global names, every EP rank's: loadable at any ep_size
        return globalize_state(self.ctx.module, out) if self.has_experts else out

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Re-partition a state saved at any world size (fp32 masters also refresh the partitions; MoE
        experts: this rank's, found under their global names)."""
        if self.has_experts:
            state = localize_state(self.ctx.module, state)
        with nvme_materialized(self._optimizer, write_back=True):
            self._load_state_dict(state, load_optimizer_states=load_optimizer_states)


    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool) -> None:
        load_partitioned_state(
            state, opt=self._optimizer, pairs=self._pairs, rank=self.rank, loss_scaler=self.loss_scaler,
            load_optimizer_states=load_optimizer_states,
            masters_loaded=lambda loaded: self._masters_to_partitions() if loaded else self._partitions_to_masters(),
            ranks=self._pair_ranks,
            load_fp32_masters=self.load_from_fp32_weights,
        )


    @torch.no_grad()
    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full state dict, gathered one unit at a time (collective: call on every rank). MoE experts are
        gathered over their expert-data-parallel group and named by their global index, every EP rank's
        (collective over the expert-parallel group, :mod:`dscore.moe.checkpoint`)."""
        module = self.ctx.module
        keys = list(module.state_dict(keep_vars=True).keys())
        values: dict[int, torch.Tensor] = {}
        for s in self.units:
            u = s.unit
            was = u.gathered
            u.gather()
            for p, v in zip(u.params, u.full_values()):
                values[id(p)] = v.clone()
            if not was:
                u.release()
        named: dict[str, torch.Tensor] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            named[n] = values[id(p)]
        for n, b in module.named_buffers(remove_duplicate=False):
            named[n] = b.detach().clone()
        out = OrderedDict((k, named[k]) for k in keys if k in named)
        return OrderedDict(ExpertNaming(module).globalize(dict(out))) if self.has_experts else out

    @torch.no_grad()
    def iter_module_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """The full state dict streamed one unit at a time, in the module's state-dict order (collective:
        every rank exhausts it). A piece holds views of the gathered unit's full buffer (and the module's
        buffers); the unit is released when the iterator resumes, so the caller copies first. At most one
        unit this iterator gathered is live at a time (persistent or already-gathered units stay as they
        were). Not with MoE experts (their global naming gathers over the expert-parallel group: use
        :meth:`module_state_dict`).

        Raises:
            RuntimeError: the model has MoE expert parameters.
        """
        if self.has_experts:
            raise RuntimeError(
                "ZeRO stage 3 streams the state dict one unit at a time, but this model has MoE expert parameters "
                "(named and gathered over the expert-parallel group as a whole): use engine.module_state_dict()"
            )
        module = self.ctx.module
        unit_of = {id(p): (s.unit, i) for s in self.units for i, p in enumerate(s.unit.params)}
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        current: Any = None  # the unit this iterator gathered and still holds
        piece: dict[str, torch.Tensor] = {}
        try:
            for key in module.state_dict(keep_vars=True).keys():
                if key in buffers:
                    piece[key] = buffers[key].detach()
                    continue
                unit, i = unit_of[id(params[key])]
                if current is not None and unit is not current:
                    yield piece  # the caller copies before resuming: only then is the unit released
                    piece = {}
                    current.release()
                    current = None
                if not unit.gathered:
                    unit.gather()
                    current = unit
                piece[key] = unit.full_values()[i]
            if piece:
                yield piece
        finally:
            if current is not None:
                current.release()

    @torch.no_grad()
    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full weights: each unit is gathered, overwritten, re-partitioned (masters refreshed). MoE
        experts: this rank's, found under their global names. Only the keys of ``module.state_dict()`` are
        read: non-persistent buffers (``register_buffer(..., persistent=False)``, e.g. a Llama's
        ``rotary_emb.inv_freq``) are never saved and keep the module's own values, as in torch.

        Raises:
            KeyError: ``strict`` and a parameter or persistent buffer is missing from ``state``, or
                ``state`` holds a key the module does not have (names them; checked before anything is
                written, so a refused load leaves the weights as they were).
        """
        module = self.ctx.module
        if self.has_experts:
            state = ExpertNaming(module).localize(dict(state))
        expected = set(module.state_dict(keep_vars=True).keys())
        if strict:
            missing = sorted(expected - set(state))
            unexpected = sorted(set(state) - expected)
            if missing or unexpected:
                raise KeyError(
                    f"the state dict does not fit the module (strict): missing keys {missing[:8]}"
                    f"{' ...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
                    f"{' ...' if len(unexpected) > 8 else ''}"
                )
        names_of: dict[int, list[str]] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(n)
        for s in self.units:
            u = s.unit
            was = u.gathered
            u.gather()
            for p, v in zip(u.params, u.full_values()):
                name = next((n for n in names_of.get(id(p), []) if n in state), None)
                if name is not None:
                    v.copy_(state[name].reshape(v.shape))
            u.write_back()
            if s.trainable and self.masters[s.key] is not None:
                self._refresh_master_from(u)
            if not was:
                u.release()
        for n, b in module.named_buffers():
            if n in expected and n in state:  # a non-persistent buffer is not in ``expected``
                b.copy_(state[n])
