"""Cross-section checks, each naming the key path at fault."""

from __future__ import annotations

from typing import Any

import pytest
from test_config_fixtures import error_of, load

BASE: dict[str, Any] = {"train_batch_size": 8}


@pytest.mark.parametrize(
    ("cfg", "path"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_optimizer.device"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param.device"),
        ({"zero_optimization": {"stage": 0, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}, "zero_optimization.offload_param.device"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_optimizer_states"),
        ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
        ({"zero_optimization": {"stage": 3}, "gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
        ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "zero_optimization.offload_optimizer.ratio"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "zero_optimization.offload_optimizer.ratio"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "zero_optimization"),
        ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "zero_optimization.zero_hpz_partition_size"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}}, "zero_optimization.offload_optimizer.super_offload"),
        ({"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
        ({"zero_optimization": {"stage": 1, "compute_grad_norm": False}, "gradient_clipping": 1.0}, "zero_optimization.compute_grad_norm"),
        ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, "zero_optimization"),
    ],
)  # fmt: skip
def test_cross_checks(cfg: dict, path: str) -> None:
    err = error_of({**BASE, **cfg})
    assert path in {p for p, _ in err.errors}
    assert path in str(err)


def test_valid_combinations_pass() -> None:
    cfg = load(
        {
            **BASE,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "data_types": {"param_dtype": "bfloat16"},
        }
    )
    assert cfg.zero_optimization.offload_param.device == "cpu" and cfg.bf16_enabled
    cfg = load(
        {
            **BASE,
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
            "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
        }
    )
    assert cfg.zero_stage == 1 and cfg.fp16_enabled


def test_all_cross_check_problems_are_reported_together() -> None:
    err = error_of(
        {
            **BASE,
            "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
        }
    )
    assert {p for p, _ in err.errors} == {
        "bf16.enabled",
        "fp16.fp16_master_weights_and_grads",
        "zero_optimization.offload_optimizer.device",
    }
