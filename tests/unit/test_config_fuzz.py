"""Property test: random nested JSON values and misspelled keys give a valid config or a ConfigError
with a key path, never any other exception."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_config_fixtures import make_registry

from dscore.config import DscoreConfig, load_config
from dscore.errors import ConfigError

REGISTRY = make_registry()

KNOWN_PATHS = [
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("gradient_clipping",),
    ("steps_per_print",),
    ("gradient_allreduce_op",),
    ("communication_data_type",),
    ("strict",),
    ("accelerator",),
    ("plugins", "disable"),
    ("checkpoint", "tag_validation"),
    ("checkpoint", "parallel_write", "pipeline_stage"),
    ("data_types", "keep_in_fp32_modules"),
    ("optimizer",),
    ("optimizer", "type"),
    ("optimizer", "params", "lr"),
    ("optimizer", "params", "betas"),
    ("scheduler", "params", "total_num_steps"),
    ("zero_optimization",),
    ("zero_optimization", "stage"),
    ("zero_optimization", "reduce_bucket_size"),
    ("zero_optimization", "stage3_prefetch_bucket_size"),
    ("zero_optimization", "cpu_offload"),
    ("zero_optimization", "offload_optimizer"),
    ("zero_optimization", "offload_optimizer", "device"),
    ("zero_optimization", "offload_optimizer", "ratio"),
    ("zero_optimization", "offload_param", "device"),
    ("zero_optimization", "mics_shard_size"),
    ("fp16",),
    ("fp16", "enabled"),
    ("fp16", "loss_scale"),
    ("fp16", "min_loss_scale"),
    ("bf16", "enabled"),
    ("bfloat16",),
    ("torch_autocast", "dtype"),
    ("tensorboard", "enabled"),
    ("comet",),
    ("comms_logger", "prof_ops"),
    ("amp",),
    ("activation_checkpointing",),
    ("tensor_parallel",),
    ("pipeline",),
    ("sequence_parallel_size",),
]
KEYS = sorted({k for path in KNOWN_PATHS for k in path} | {"enabled", "params", "type", "device"})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["auto", "cpu", "nvme", "Adam", "fp16", "", "WARN", "true", "1e3"]),
    st.text(max_size=8),
)


@st.composite
def misspelled(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from(KEYS))
    i = draw(st.integers(min_value=0, max_value=len(key) - 1))
    op = draw(st.sampled_from(["drop", "double", "swap", "replace"]))
    if op == "drop":
        return key[:i] + key[i + 1 :]
    if op == "double":
        return key[:i] + key[i] + key[i:]
    if op == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    return key[:i] + draw(st.sampled_from("abcxyz_")) + key[i + 1 :]


keys = st.one_of(st.sampled_from(KEYS), misspelled(), st.text(max_size=6))
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)),
    max_leaves=12,
)


def _set(cfg: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = cfg
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
    }
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        path = draw(st.sampled_from(KNOWN_PATHS))
        if draw(st.booleans()):
            # misspell one component of the path
            index = draw(st.integers(min_value=0, max_value=len(path) - 1))
            path = (*path[:index], draw(misspelled()), *path[index + 1 :])
        _set(cfg, path, draw(json_values))
    if draw(st.booleans()):
        cfg.update(draw(st.dictionaries(keys, json_values, max_size=3)))
    return cfg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=configs(), world_size=st.integers(min_value=1, max_value=16))
def test_only_valid_config_or_config_error(cfg: dict[str, Any], world_size: int) -> None:
    try:
        result = load_config(cfg, world_size=world_size, registry=REGISTRY)
    except ConfigError as exc:
        assert exc.path, f"no key path in {exc}"
        assert exc.errors and all(path for path, _ in exc.errors), exc.errors
        assert str(exc)
    else:
        assert isinstance(result, DscoreConfig)
        assert (
            result.train_batch_size
            == result.train_micro_batch_size_per_gpu * result.gradient_accumulation_steps * world_size
        )


@settings(max_examples=100, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=40), st.binary(max_size=40).map(lambda b: __import__("base64").urlsafe_b64encode(b).decode())
    )
)
def test_random_text_sources_only_raise_config_error(text: str) -> None:
    try:
        result = load_config(text, registry=REGISTRY)
    except ConfigError as exc:
        assert str(exc)
    else:  # only possible when the text decodes to a valid config
        assert isinstance(result, DscoreConfig)
