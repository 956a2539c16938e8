"""Core model, plugin sections, unknown keys, "auto", optimizer/scheduler params, registration rules."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
from pydantic import ValidationError
from test_config_fixtures import error_of, load, make_registry, section_plugin

from dscore.config import DscoreConfig, load_config
from dscore.config.keys import DEEPSPEED_KEYS, GATED_KEYS, IGNORED_KEYS
from dscore.config.model import CORE_KEYS
from dscore.errors import ConfigError, PluginConflictError

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_mirror_deepspeed_0_19_8() -> None:
    cfg = load({"train_batch_size": 8})
    assert isinstance(cfg, DscoreConfig)
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print is None
    assert cfg.wall_clock_breakdown is False and cfg.dataloader_drop_last is False
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.gradient_allreduce_op == "mean" and cfg.communication_data_type is None
    assert cfg.zero_allow_untested_optimizer is False and cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.managed_gradient_accumulation is True
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.checkpoint.tag_validation == "WARN"
    assert cfg.accelerator is None and cfg.plugins.disable == []
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 500_000_000, 500_000_000)
    assert zero.overlap_comm is False and zero.contiguous_gradients is True and zero.reduce_scatter is True
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (50_000_000, 100_000)
    assert (zero.max_live_parameters, zero.max_reuse_distance, zero.sub_group_size) == (10**9, 10**9, 10**9)
    assert zero.gather_16bit_weights_on_model_save is False and zero.round_robin_gradients is False
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (False, 0, 16, 1000)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == (2, False, 1, False)
    assert cfg.bf16.enabled is False and cfg.bf16.check_grad_overflow is True
    assert cfg.tensorboard.job_name == "DeepSpeedJobName" and cfg.wandb.project == "deepspeed"
    assert cfg.comms_logger.prof_all is True
    assert (cfg.zero_stage, cfg.fp16_enabled, cfg.bf16_enabled) == (0, False, False)


def test_config_is_frozen() -> None:
    cfg = load({"train_batch_size": 8})
    with pytest.raises(ValidationError):
        cfg.train_batch_size = 16  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 2  # type: ignore[misc]


def test_values_and_aliases() -> None:
    cfg = load(
        {
            "train_batch_size": 8,
            "steps_per_print": 10,
            "gradient_clipping": 0,
            "gradient_allreduce_op": "MEAN",
            "communication_data_type": "BF16",
            "checkpoint": {"tag_validation": "fail"},
            "accelerator": "cpu",
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 2e7,
                "stage3_param_persistence_threshold": 1e4,
                "stage3_max_live_parameters": 10,
                "stage3_gather_16bit_weights_on_model_save": True,
                "offload_optimizer": {"device": "CPU"},
                "offload_param": {},
            },
        }
    )
    assert cfg.steps_per_print == 10 and cfg.gradient_clipping == 0.0
    assert cfg.gradient_allreduce_op == "mean" and cfg.communication_data_type == "bf16"
    assert load({"train_batch_size": 8, "gradient_allreduce_op": "Sum"}).gradient_allreduce_op == "sum"
    assert cfg.checkpoint.tag_validation == "FAIL" and cfg.accelerator == "cpu"
    zero = cfg.zero_optimization
    assert zero.prefetch_bucket_size == 20_000_000 and isinstance(zero.prefetch_bucket_size, int)
    assert zero.param_persistence_threshold == 10_000 and zero.max_live_parameters == 10
    assert zero.gather_16bit_weights_on_model_save is True and zero.overlap_comm is True
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param.device == "none"


@pytest.mark.parametrize(
    ("cfg", "path"),
    [
        ({"checkpoint": {"tag_validation": "sometimes"}}, "checkpoint.tag_validation"),
        ({"gradient_clipping": -1}, "gradient_clipping"),
        ({"gradient_clipping": float("inf")}, "gradient_clipping"),
        ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_size": "big"}},
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}, "stage": 2}},
            "zero_optimization.offload_optimizer",
        ),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16"),
        ({"fp16": {"loss_scale": True}}, "fp16.loss_scale"),
        ({"torch_autocast": {"dtype": "float64"}}, "torch_autocast.dtype"),
        ({"checkpoint": {"parallel_write": {"pipeline_stage": "yes"}}}, "checkpoint.parallel_write.pipeline_stage"),
    ],
)
def test_invalid_values_have_dotted_paths(cfg: dict, path: str) -> None:
    err = error_of({"train_batch_size": 8, **cfg})
    assert err.path == path
    assert path in str(err)


def test_unknown_keys_issue_example() -> None:
    err = error_of({"train_batch_size": 8, "zero_optimisation": {"stage": 2}, "gradient_acumulation_steps": 2})
    paths = {p for p, _ in err.errors}
    assert paths == {"zero_optimisation", "gradient_acumulation_steps"}
    text = str(err)
    assert "did you mean 'zero_optimization'" in text
    assert "did you mean 'gradient_accumulation_steps'" in text


def test_unknown_nested_keys_suggest_from_their_own_section() -> None:
    err = error_of(
        {
            "train_batch_size": 8,
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 1, "offload_param": {"devise": "cpu"}},
            "fp16": {"enabeld": True},
        }
    )
    messages = dict(err.errors)
    assert "stage3_prefetch_bucket_size" in messages["zero_optimization.stage3_prefetch_bucket_sise"]
    assert "'device'" in messages["zero_optimization.offload_param.devise"]
    assert "'enabled'" in messages["fp16.enabeld"]


def test_lenient_switch_in_config_and_argument() -> None:
    cfg = load({"train_batch_size": 8, "strict": False, "zero_optimisation": {"stage": 2}, "fp16": {"enabeld": True}})
    assert cfg.zero_stage == 0 and cfg.fp16_enabled is False
    assert any("zero_optimisation" in w and "zero_optimization" in w for w in cfg.warnings)
    assert any("fp16.enabeld" in w for w in cfg.warnings)
    cfg = load({"train_batch_size": 8, "bogus": 1}, strict=False)
    assert any("bogus" in w for w in cfg.warnings)
    with pytest.raises(ConfigError):
        load({"train_batch_size": 8, "strict": False, "bogus": 1}, strict=True)
    # lenient never hides a bad value
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        load({"train_batch_size": 8, "strict": False, "zero_optimization": {"stage": 9}})


def test_auto_model_dependent_values() -> None:
    cfg = load(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        }
    )
    assert set(cfg.pending_auto) == {
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    }
    resolved = cfg.resolve_model_auto(4096)
    zero = resolved.zero_optimization
    assert zero.reduce_bucket_size == 4096 * 4096
    assert zero.prefetch_bucket_size == int(0.9 * 4096 * 4096)
    assert zero.param_persistence_threshold == 40960
    assert resolved.pending_auto == [] and resolved.raw["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096
    assert cfg.zero_optimization.reduce_bucket_size == "auto"  # the original is unchanged
    with pytest.raises(ConfigError, match="hidden size must be a positive integer") as info:
        cfg.resolve_model_auto(0)
    assert len(info.value.errors) == 3


def test_auto_elsewhere_is_one_error_listing_every_path() -> None:
    err = error_of(
        {
            "train_batch_size": 8,
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto", "loss_scale": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "zero_optimization": {"allgather_bucket_size": "auto"},
        }
    )
    paths = {p for p, _ in err.errors}
    assert paths == {
        "gradient_clipping",
        "fp16.enabled",
        "fp16.loss_scale",
        "optimizer.params.lr",
        "zero_optimization.allgather_bucket_size",
    }
    assert all('unresolved "auto"' in m for _, m in err.errors)


def test_auto_as_a_value_of_its_own() -> None:
    cfg = load({"train_batch_size": 8, "data_types": {"keep_in_fp32_modules": "auto", "grad_accum_dtype": "FP32"}})
    assert cfg.data_types.keep_in_fp32_modules == "auto" and cfg.data_types.grad_accum_dtype == "fp32"


def test_optimizer_and_scheduler_params_use_the_plugin_model() -> None:
    cfg = load(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
        }
    )
    assert cfg.optimizer.type == "adamw"  # as written
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95]}  # no defaults injected
    assert cfg.scheduler.params == {"total_num_steps": 100}
    err = error_of(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "Adam", "params": {"lr": "fast", "beta": [0.9, 0.9]}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
        }
    )
    messages = dict(err.errors)
    assert "optimizer.params.lr" in messages
    assert "did you mean 'betas'" in messages["optimizer.params.beta"]
    assert "scheduler.params.total_num_steps" in messages
    # no params model: anything goes
    assert load({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}).optimizer.params


def test_optimizer_errors() -> None:
    err = error_of({"train_batch_size": 8, "optimizer": {"type": "Adamm"}})
    assert err.path == "optimizer.type" and "Did you mean 'Adam'" in str(err)
    err = error_of({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert err.path == "optimizer.params.max_grad_norm" and "gradient_clipping" in str(err)
    cfg = load({"train_batch_size": 8, "optimizer": {"params": {"lr": 1}}})
    assert cfg.optimizer is None and any("no 'type'" in w for w in cfg.warnings)


def test_section_conflicts_are_plugin_errors() -> None:
    twin = section_plugin("fp16", "dscore_plugins.precision.config:Fp16Config")
    with pytest.raises(PluginConflictError, match="'fp16'"):
        load_config({"train_batch_size": 8}, registry=make_registry(("twin", twin)))
    core = section_plugin("gradient_clipping", "dscore_plugins.precision.config:Fp16Config")
    with pytest.raises(PluginConflictError, match="gradient_clipping"):
        load_config({"train_batch_size": 8}, registry=make_registry(("core", core)))


def test_a_plugin_section_gets_strict_checking() -> None:
    extra = section_plugin("my_monitor", "dscore_plugins.monitor.config:WandbConfig", aliases=("my_mon",))
    registry = make_registry(("mine", extra))
    cfg = load_config({"train_batch_size": 8, "my_mon": {"project": "p"}}, registry=registry)
    assert cfg.my_monitor.project == "p"
    with pytest.raises(ConfigError, match="my_monitor.projct"):
        load_config({"train_batch_size": 8, "my_monitor": {"projct": "p"}}, registry=registry)


def test_unowned_deepspeed_section_is_gated() -> None:
    registry = make_registry(sections=False)
    cfg = load_config(
        {"train_batch_size": 8, "zero_optimization": {"stage": 0}, "fp16": {"enabled": False}}, registry=registry
    )
    assert not hasattr(cfg, "zero_optimization") and cfg.zero_stage == 0
    assert any("zero_optimization" in w for w in cfg.warnings)
    with pytest.raises(ConfigError, match="no active plugin registers the 'zero_optimization' section"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}}, registry=registry)


def test_every_deepspeed_top_level_key_is_known() -> None:
    deepspeed_0_19_8 = {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "managed_gradient_accumulation", "steps_per_print", "gradient_clipping", "prescale_gradients",
        "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
        "seq_parallel_communication_data_type", "disable_allgather", "dump_state", "disable_python_gc",
        "memory_breakdown", "wall_clock_breakdown", "vocabulary_size", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "bfloat16",
        "torch_autocast", "checkpoint", "data_types", "dataloader_drop_last", "log_level", "pipeline",
        "hybrid_engine", "flops_profiler", "activation_checkpointing", "aio", "tensorboard", "csv_monitor",
        "wandb", "comet", "comms_logger", "autotuning", "timers", "compile", "tensor_parallel",
        "expert_parallel", "data_efficiency", "weight_quantization", "use_data_before_expert_parallelism",
        "sequence_parallel_size", "data_parallel_size", "amp", "elasticity", "sparse_attention",
        "compression_training", "curriculum_learning", "progressive_layer_drop", "eigenvalue",
        "quantize_training", "nebula", "sparse_gradients", "graph_harvesting",
    }  # fmt: skip
    assert deepspeed_0_19_8 <= (CORE_KEYS | DEEPSPEED_KEYS)
    assert not (set(GATED_KEYS) & set(IGNORED_KEYS))


def test_field_docs_come_from_attribute_docstrings() -> None:
    cfg = load({"train_batch_size": 8})
    assert "1.0" in type(cfg).model_fields["gradient_clipping"].description
    assert type(cfg.zero_optimization).model_fields["prefetch_bucket_size"].description


def test_core_never_imports_plugins() -> None:
    offenders = []
    for path in (REPO / "dscore").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0] in {"dscore_plugins", "dscore_accelerators"}]
    assert offenders == []


def test_config_package_and_check_are_torch_free(tmp_path: pathlib.Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}')
    code = (
        "import sys, dscore, dscore.config\n"
        "from dscore.cli.main import main\n"
        f"rc = main(['config', 'check', {str(cfg)!r}, '--json'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
