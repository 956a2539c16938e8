"""``optimizer.parameter_offload``: the handle on ZeRO stage 3's module hooks that RLHF libraries use.

DeepSpeed 0.19.8's stage-3 optimizer holds a ``DeepSpeedZeRoOffload`` as ``parameter_offload``; TRL's
``unwrap_model_for_generation`` (``trl/models/utils.py``: ``remove_hooks`` / ``add_hooks``) gathers the whole
model with ``GatheredParameters``, clears every parameter's ``ds_active_sub_modules``, removes the handles in
``forward_hooks`` and ``backward_hooks`` so generation runs without per-module gathers, then invalidates
``param_coordinator``'s trace and calls ``_register_deepspeed_module(module)`` to put the hooks back.

:class:`ParameterOffload` gives those names their real effect on dscore's stage 3: ``forward_hooks`` are the
handles of the stage's forward pre/post hooks (gather, prefetch, release; the pre-backward re-gather is
registered by the post-forward hook on each forward's outputs, so it goes with them); ``backward_hooks`` is
empty, because dscore registers no persistent module backward hooks (gradient reduction hooks belong to the
optimizer, as DeepSpeed's ``_grad_acc_hooks``, and stay). Re-registering replaces whatever hooks are
registered, so hooks are never doubled.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ParameterCoordinatorView", "ParameterOffload", "install_external_parameter_views"]


class ParameterCoordinatorView:
    """``parameter_offload.param_coordinator``: the stage's forward-order trace (prefetch order).

    DeepSpeed's coordinator re-records its trace after ``_invalidate_trace()``; dscore's stage records the
    order of the next training forward and adopts it at that micro step's backward.
    """

    def __init__(self, stage: Any) -> None:
        self._stage = stage

    def is_invalid_trace(self) -> bool:
        """True while the stage is (re-)recording the forward order (before the first backward, or after
        :meth:`_invalidate_trace` until the next backward)."""
        return self._stage._recording is not None

    def _invalidate_trace(self) -> None:
        """Record the forward order again on the next training forward (DeepSpeed's name)."""
        self._stage._recording = []

    invalidate_trace = _invalidate_trace


class ParameterOffload:
    """What ``engine.optimizer.parameter_offload`` is under dscore's ZeRO stage 3 (module docstring).

    Attributes:
        module: the engine's module (the stage's root).
        forward_hooks: ``torch.utils.hooks.RemovableHandle`` of every forward pre/post hook the stage
            registered; ``hook.remove()`` on each (and emptying the list) leaves the model without
            just-in-time gathers until :meth:`_register_deepspeed_module`.
        backward_hooks: always-empty list of module backward hooks (see the module docstring).
        param_coordinator: a :class:`ParameterCoordinatorView`.
    """

    def __init__(self, stage: Any) -> None:
        self._stage = stage  # the Stage3 (typed Any: stage3 imports this module)
        self.module: torch.nn.Module = stage.ctx.module
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []
        self.param_coordinator = ParameterCoordinatorView(stage)

    def get_param_coordinator(self) -> ParameterCoordinatorView:
        """DeepSpeed's accessor for :attr:`param_coordinator`."""
        return self.param_coordinator

    def _register_deepspeed_module(self, module: torch.nn.Module, count: Any = None) -> None:
        """(Re-)register the stage's module hooks on ``module``, the engine's module: hooks still
        registered are removed first, and the forward trace is re-recorded on the next training forward.

        Raises:
            ValueError: ``module`` is not the module the engine manages (dscore hooks only that tree).
        """
        if module is not self.module:
            raise ValueError(
                f"parameter_offload._register_deepspeed_module({type(module).__name__}): dscore's ZeRO stage 3 hooks "
                f"only the engine's own module ({type(self.module).__name__}); pass engine.module"
            )
        self.remove_module_hooks()
        self._stage._recording = []
        self.forward_hooks = self._stage._register_module_hooks()

    def remove_module_hooks(self) -> None:
        """Remove every registered stage hook (DeepSpeed's ``DeepSpeedZeRoOffload.remove_module_hooks``)."""
        for h in [*self.forward_hooks, *self.backward_hooks]:
            h.remove()
        self.forward_hooks = []
        self.backward_hooks = []

    def __repr__(self) -> str:
        return f"ParameterOffload(forward_hooks={len(self.forward_hooks)}, backward_hooks={len(self.backward_hooks)})"


def _external_parameters(self: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    # dscore's stage 3 refuses registering a partitioned parameter with another module
    # (deepspeed.zero.register_external_parameter raises), so no module has external parameters
    return list(self.__dict__.get("_external_params", {}).items())


def _all_parameters(self: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    yield from self.named_parameters(recurse=False)
    yield from _external_parameters(self)


def install_external_parameter_views(module: torch.nn.Module) -> None:
    """Give every submodule DeepSpeed's ``ds_external_parameters()`` (``(name, parameter)`` pairs registered
    with another module: always none under dscore, which refuses such registrations) and ``all_parameters()``
    (its own direct parameters, then those), as DeepSpeed's ``zero.Init`` does; TRL's ``remove_hooks`` walks
    ``named_parameters()`` chained with the root's ``ds_external_parameters()``."""
    for m in module.modules():
        if "ds_external_parameters" not in m.__dict__:
            m.ds_external_parameters = types.MethodType(_external_parameters, m)
            m.all_parameters = types.MethodType(_all_parameters, m)
