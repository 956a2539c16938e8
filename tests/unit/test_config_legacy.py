"""Legacy forms migrate with a warning naming the new key; removed and unimplemented keys are ignored
when inert and refused when they would change training."""

from __future__ import annotations

from typing import Any

import pytest
from test_config_fixtures import error_of, load

BASE: dict[str, Any] = {"train_batch_size": 8}


def _load(**cfg: Any) -> Any:
    return load({**BASE, **cfg})


def test_zero_optimization_true_and_false() -> None:
    cfg = _load(zero_optimization=True, allgather_size=1000)
    assert cfg.zero_stage == 1 and cfg.zero_optimization.allgather_bucket_size == 1000
    assert any("zero_optimization.stage" in w for w in cfg.warnings)
    assert cfg.raw["zero_optimization"] == {"stage": 1, "allgather_bucket_size": 1000}
    cfg = _load(zero_optimization=True)
    assert cfg.zero_optimization.allgather_bucket_size == 500_000_000
    cfg = _load(zero_optimization=False)
    assert cfg.zero_stage == 0 and any("zero_optimization.stage" in w for w in cfg.warnings)


def test_cpu_offload_flags() -> None:
    cfg = _load(zero_optimization={"stage": 3, "cpu_offload": True, "cpu_offload_param": True})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert any("zero_optimization.offload_optimizer" in w for w in cfg.warnings)
    assert any("zero_optimization.offload_param" in w for w in cfg.warnings)
    cfg = _load(zero_optimization={"stage": 2, "cpu_offload": False, "cpu_offload_use_pin_memory": True})
    assert cfg.zero_optimization.offload_optimizer is None
    assert any("cpu_offload_use_pin_memory" in w and "pin_memory" in w for w in cfg.warnings)
    err = error_of(
        {**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}
    )
    assert err.path == "zero_optimization.cpu_offload"
    err = error_of({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": "yes"}})
    assert err.path == "zero_optimization.cpu_offload"


def test_gather_fp16_weights_key() -> None:
    cfg = _load(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True})
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True
    assert any("gather_16bit_weights_on_model_save" in w for w in cfg.warnings)
    err = error_of(
        {
            **BASE,
            "zero_optimization": {
                "stage3_gather_fp16_weights_on_model_save": True,
                "stage3_gather_16bit_weights_on_model_save": False,
            },
        }
    )
    assert err.path == "zero_optimization.stage3_gather_fp16_weights_on_model_save"


def test_bfloat16_alias() -> None:
    cfg = _load(bfloat16={"enabled": True})
    assert cfg.bf16_enabled and any("'bf16'" in w for w in cfg.warnings)
    cfg = _load(bfloat16={"enabled": True}, bf16={"enabled": False})
    assert cfg.bf16_enabled is False and any("'bfloat16' is ignored" in w for w in cfg.warnings)


@pytest.mark.parametrize(
    ("key", "inert", "active"),
    [
        ("amp", {"enabled": False, "opt_level": "O1"}, {"enabled": True}),
        ("elasticity", {"enabled": False}, {"enabled": True, "max_train_batch_size": 64}),
        ("sparse_attention", None, {"mode": "fixed"}),
        ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": False}}},
         {"weight_quantization": {"shared_parameters": {"enabled": True}}}),
        ("curriculum_learning", {"enabled": False}, {"enabled": True}),
        ("progressive_layer_drop", {"enabled": False, "theta": 0.5}, {"enabled": True}),
        ("eigenvalue", {"enabled": False}, {"enabled": True}),
        ("quantize_training", {"enabled": False}, {"enabled": True}),
        ("nebula", {"enabled": False}, {"enabled": True}),
        ("sparse_gradients", False, True),
        ("graph_harvesting", False, True),
        ("autotuning", {"enabled": False}, {"enabled": True}),
        ("compile", {"deepcompile": False}, {"deepcompile": True}),
        ("data_efficiency", {"enabled": False, "data_sampling": {"enabled": False}},
         {"enabled": True}),
        ("weight_quantization", None, {"post_init_quant": {"fc": {"num_bits": 8}}}),
        ("use_data_before_expert_parallelism", False, True),
    ],
)  # fmt: skip
def test_gated_keys(key: str, inert: Any, active: Any) -> None:
    cfg = _load(**{key: inert})
    assert any(repr(key) in w and "ignored" in w for w in cfg.warnings)
    assert key not in type(cfg).model_fields
    err = error_of({**BASE, key: active})
    assert err.path == key
    assert "dscore does not implement" in str(err) and key in str(err)


# "aio" is a validated section of the ops plugin now (tests/ops/test_async_io.py); "pipeline" of the
# engine plugin (tests/pipeline/test_pipeline_unit.py)
@pytest.mark.parametrize("key", ["timers", "memory_breakdown", "dump_state", "vocabulary_size"])
def test_ignored_keys_warn(key: str) -> None:
    cfg = _load(**{key: {"anything": 1} if key == "timers" else True})
    assert any(repr(key) in w and "ignored" in w for w in cfg.warnings)


def test_comet_is_validated_and_refused_when_enabled() -> None:
    cfg = _load(comet={"enabled": False, "project": "p"})
    assert cfg.comet.project == "p"
    err = error_of({**BASE, "comet": {"enabled": True}})
    assert err.path == "comet.enabled" and "no installed monitor plugin" in str(err)
    assert error_of({**BASE, "comet": {"projekt": "p"}}).path == "comet.projekt"


@pytest.mark.parametrize(
    ("zero", "inert"),
    [
        ({"mics_shard_size": -1}, True),
        ({"mics_shard_size": 8}, False),
        ({"mics_hierarchical_params_gather": False}, True),
        ({"mics_hierarchical_params_gather": True}, False),
        ({"zeropp_loco_param": None}, True),
        ({"zeropp_loco_param": {"err_beta": 0.8}}, False),
        ({"zenflow": None}, True),
        ({"zenflow": {"topk_ratio": 0.1}}, False),
    ],
)
def test_removed_zero_keys(zero: dict, inert: bool) -> None:
    key = next(iter(zero))
    if inert:
        cfg = _load(zero_optimization={"stage": 2, **zero})
        assert any(f"zero_optimization.{key}" in w for w in cfg.warnings)
    else:
        err = error_of({**BASE, "zero_optimization": {"stage": 2, **zero}})
        assert err.path == f"zero_optimization.{key}" and "does not implement" in str(err)


def test_hybrid_engine_block_is_a_section_with_deepspeed_defaults() -> None:
    """Issue 40: ``hybrid_engine`` is the engine plugin's section (DeepSpeed 0.19.8's keys and defaults), not
    a gated key; a bad value names its key path."""
    from dscore.errors import ConfigError
    from dscore.testing.contexts import local_config

    cfg = local_config({"hybrid_engine": {"enabled": True}})
    section = cfg.section("hybrid_engine")
    assert (section.enabled, section.max_out_tokens, section.inference_tp_size, section.release_inference_cache,
            section.pin_parameters, section.tp_gather_partition_size, section.enable_cuda_graph) == (
        True, 512, 1, False, True, 8, False)  # fmt: skip
    with pytest.raises(ConfigError) as err:
        local_config({"hybrid_engine": {"enabled": True, "max_out_tokens": 0}})
    assert "hybrid_engine.max_out_tokens" in str(err.value)
