"""``dscore.zero.fragments`` refuses, naming what is wrong, a tensor no engine trains and a ZeRO stage
that does not implement ``ZeroStage.param_fragment`` (a third-party stage: the core names no built-in)."""

from __future__ import annotations

import pytest
import torch

from dscore.errors import FragmentAccessError
from dscore.protocols.zero import ZeroStage
from dscore.zero import fragments


def test_a_tensor_no_engine_trains_is_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(FragmentAccessError, match=r"shape \(2, 3\) is not a parameter of a live dscore engine"):
        fragments.get_full_fp32_param(p)
    with pytest.raises(FragmentAccessError, match="expected a module parameter"):
        fragments.get_full_grad([1, 2])  # type: ignore[arg-type]


def test_a_stage_without_param_fragment_is_named() -> None:
    third_party = type("ThirdPartyStage", (ZeroStage,), {"__module__": "acme_zero.stage"})
    third_party.__abstractmethods__ = frozenset()  # only param_fragment's default matters here
    stage = third_party(None)  # type: ignore[arg-type]
    p = torch.nn.Parameter(torch.zeros(4))
    fragments.attach(stage, [p])
    with pytest.raises(FragmentAccessError, match=r"not provided by acme_zero\.stage\.ThirdPartyStage"):
        fragments.get_full_optimizer_state(p, "exp_avg")
    import deepspeed.utils as dsu

    with pytest.raises(FragmentAccessError, match="ZeroStage.param_fragment"):
        dsu.safe_get_full_fp32_param(p)
    del stage  # the parameter holds the stage weakly: gone with it
    with pytest.raises(FragmentAccessError, match="not a parameter of a live dscore engine"):
        fragments.get_local_fp32_param(p)
