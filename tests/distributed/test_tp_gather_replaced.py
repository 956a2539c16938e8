"""``GatherReplacedLayerParams`` (DeepSpeed 0.19.8's ``deepspeed.module_inject.layers`` context manager) on
dscore's AutoTP, 2 gloo ranks at tp 2, ZeRO 0 and ZeRO 3 (inside ``GatheredParameters``): inside it the
split parameters are the full tensors, afterwards the shards again; nesting, a single tensor,
``enabled=False``, a module without split parameters, the row layer's replicated bias; an edit inside it is
kept (in the shards, the consolidated state dict and the forward); ZeRO-3 without the outer gather is
refused. Rank function: tp_gather_runs.py."""

from __future__ import annotations

import pytest
import tp_gather_runs  # tests/distributed is on sys.path: pytest's prepend import mode

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def test_gather_replaced_layer_params_at_zero_0_and_3() -> None:
    results = run_distributed(tp_gather_runs.gather_checks, 2, timeout=300)
    for res in results:
        assert res["compat_is_dscore"]
        for stage in (0, 3):
            r = res[stage]
            assert r["split_before"], stage
            assert r["per_layer_full"] and all(r["per_layer_full"].values()), (stage, r["per_layer_full"])
            assert r["shapes_restored"] and r["whole_full"], stage
            assert r["nested_shape"] == r["after_nested_shape"] == (32, 32), stage  # full, not gathered twice
            assert r["disabled_shape"] == (16, 32), stage
            assert r["norm_enabled"] is False, stage
            assert r["row_shapes"] == ((32, 32), (32,)), stage  # the replicated bias untouched
            assert r["edit_kept_shard"] and r["edit_in_state_dict"] and r["others_in_state_dict"], stage
            assert r["loss_changed"], stage
            assert "params must be tensors" in r["bad_param"], stage
        assert "GatheredParameters" in res[3]["unguarded"] and "partitioned" in res[3]["unguarded"]
