"""Mixture of experts with expert parallelism (DeepSpeed 0.19.8's ``deepspeed.moe``).

Modules (import them directly; this package imports nothing, so it stays torch-free):

* :mod:`dscore.moe.layer`: :class:`~dscore.moe.layer.MoE`, the layer users put in their model;
* :mod:`dscore.moe.sharded_moe`: top-1/top-2/top-k gating with capacity and the all-to-all dispatch;
* :mod:`dscore.moe.experts`: the local experts;
* :mod:`dscore.moe.groups`: expert-parallel and expert-data-parallel process groups;
* :mod:`dscore.moe.utils`: ``split_params_into_different_moe_groups_for_optimizer`` and helpers.
"""

from __future__ import annotations

__all__: list[str] = []
