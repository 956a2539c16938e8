"""AutoEP (``expert_parallel``) in one process: the block's keys are validated with DeepSpeed 0.19.8's names
and values (what dscore cannot honour is refused naming the key and what is valid), the routing keys change
routing as DeepSpeed's do, and the combinations AutoEP does not implement are refused by
``dscore.initialize``. The 2-rank numerics are ``tests/distributed/test_autoep.py``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dscore.config import load_config
from dscore.errors import ConfigError

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import autoep_runs  # noqa: E402


def _load(block: dict[str, Any]) -> Any:
    return load_config({"train_batch_size": 2, "expert_parallel": {"enabled": True, **block}}, world_size=1)


@pytest.mark.parametrize(
    "block, message",
    [
        ({"score_func": "relu"}, r"score_func.*'auto', 'softmax' or 'sigmoid'|score_func.*softmax.*sigmoid"),
        ({"score_apply": "mid"}, "score_apply"),
        ({"preset_model": "qwen3_5_moe"}, "preset_model 'qwen3_5_moe'.*valid: mixtral, qwen3_moe"),
        ({"preset_model": "llama"}, "preset_model 'llama' is not one of mixtral, qwen3_moe, deepseek_v2, deepseek_v3"),
        ({"comm_backend": "deepep"}, "expert_parallel.comm_backend"),
        ({"comm_num_sm": 24}, "expert_parallel.comm_num_sm"),
        ({"row_weighting_impl": "fused"}, "row_weighting_impl 'fused'"),
        ({"expert_w3": "up_proj"}, "expert_parallel.expert_w3"),
        ({"expert_tensor_parallel_size": 2}, "expert_parallel.expert_tensor_parallel_size"),
        ({"validate_folding_routing": True}, "expert_parallel.validate_folding_routing"),
        ({"load_balance_coeff": 0.001}, "expert_parallel.load_balance_coeff"),
        ({"expert_activation": "swiglu_oai"}, "swiglu_oai.*valid: swiglu, geglu_tanh"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": "two"}, "top_k"),
        ({"autoep_size": 0}, "autoep_size"),
        ({"router_pattern": "mlp.gate"}, "router_pattern"),
        ({"moe_layer_pattern": "model.layers.(\\d+"}, "moe_layer_pattern"),
        ({"num_expert_groups": 2, "num_limited_groups": 3}, "num_limited_groups"),
        ({"routed_scaling_factor": "big"}, "routed_scaling_factor"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_expert_parallel_block_refuses_what_dscore_cannot_honour(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(block)


def test_expert_parallel_block_defaults_are_deepspeeds() -> None:
    cfg = load_config({"train_batch_size": 2}, world_size=1).expert_parallel
    assert (cfg.enabled, cfg.autoep_size, cfg.preset_model, cfg.top_k, cfg.score_func, cfg.score_apply) == (
        False, 1, None, "auto", "auto", "auto")  # fmt: skip
    assert (cfg.route_norm, cfg.route_scale, cfg.routed_scaling_factor, cfg.comm_backend, cfg.load_balance_coeff) == (
        None, 1.0, "auto", "comm", None)  # fmt: skip
    # a disabled block with DeepSpeed's tuning keys loads (no longer a gated key)
    assert not _load({"enabled": False, "use_grouped_mm": False}).expert_parallel.enabled


def _init(model: Any, stage: int = 0, **block: Any) -> Any:
    import dscore

    engine, *_ = dscore.initialize(model=model, config=autoep_runs.config(stage, 1, **block))
    return engine


def _logits(model: Any) -> torch.Tensor:
    ids = autoep_runs.batch(0, 0)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "model, block, message",
    [
        ("mixtral", {"preset_model": "deepseek_v3"}, "preset_model 'deepseek_v3' does not fit the model"),
        ("llama", {}, "expert_parallel.preset_model"),
        ("mixtral", {"moe_layer_pattern": r"model\.norm"}, "no MoE block found"),
        ("mixtral", {"top_k": 5}, "top_k = 5 exceeds the 4 experts"),
        ("mixtral", {"autoep_size": 2}, "autoep_size = 2 must divide the data-parallel world size 1"),
        ("deepseek_v3", {"num_limited_groups": 2, "num_expert_groups": 3}, "num_expert_groups 3"),
        ("jitter", {}, "router_jitter_noise"),
        ("gelu", {}, "expert_parallel.expert_activation"),
        # a declared shared-experts part the block lacks would be dropped from the output: refused
        ("mixtral", {"has_shared_experts": True}, "has_shared_experts is true but model.layers.0.mlp has no"),
        ("qwen3_moe", {"has_shared_experts": True, "shared_experts_pattern": "shared"}, "has no shared-experts child"),
        ("qwen2_moe", {"shared_experts_gate_pattern": "sgate"}, "shared_experts_gate_pattern = 'sgate'"),
    ],
)
def test_initialize_refuses_models_autoep_cannot_convert(model: str, block: dict[str, Any], message: str) -> None:
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4))  # fmt: skip
    elif model in ("jitter", "gelu"):
        m = autoep_runs.build("mixtral")
        if model == "jitter":
            m.config.router_jitter_noise = 0.1
        else:
            from transformers.activations import ACT2FN

            for layer in m.model.layers:
                layer.mlp.experts.act_fn = ACT2FN["gelu_pytorch_tanh"]
    else:
        m = autoep_runs.build(model)
    with pytest.raises(ConfigError, match=message):
        _init(m, **block)


def test_hf_state_dict_refuses_stage3_partitions_and_initialize_an_optimizer_instance() -> None:
    import dscore
    from dscore.moe.autoep import hf_state_dict

    engine = _init(autoep_runs.build("mixtral"), stage=3)  # AutoEP trains at ZeRO-3 (tests/distributed)
    with pytest.raises(ConfigError, match="hf_state_dict needs full parameters"):
        hf_state_dict(engine.module)
    m = autoep_runs.build("mixtral")
    cfg = autoep_runs.config(0, 1)
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match="with an optimizer instance"):
        dscore.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg)


def test_routing_keys_change_routing_as_deepspeeds_do() -> None:
    """autoep_size 1 (no all-to-all): defaults equal HF; ``top_k`` 1 equals HF built with one expert per
    token; ``expert_activation`` geglu_tanh equals HF with that activation; ``route_norm`` false and
    ``routed_scaling_factor`` change the output by the expected mixing."""
    from transformers.activations import ACT2FN

    ref = autoep_runs.build("mixtral")
    assert float((_logits(_init(copy.deepcopy(ref)).module) - _logits(ref)).abs().max()) < 1e-5
    ref1 = autoep_runs.build("mixtral")
    for layer in ref1.model.layers:  # HF routes with its router's top_k
        layer.mlp.gate.top_k = layer.mlp.top_k = 1
    assert float((_logits(_init(autoep_runs.build("mixtral"), top_k=1).module) - _logits(ref1)).abs().max()) < 1e-5
    gelu = autoep_runs.build("mixtral")
    for layer in gelu.model.layers:
        layer.mlp.experts.act_fn = ACT2FN["gelu_pytorch_tanh"]
    engine = _init(copy.deepcopy(gelu), expert_activation="geglu_tanh")
    assert float((_logits(engine.module) - _logits(gelu)).abs().max()) < 1e-5
    # Mixtral renormalises; without it (and scaled by 2) the block output changes
    x = torch.randn(2, 4, 32)
    base = _init(autoep_runs.build("mixtral")).module.model.layers[0].mlp
    other = _init(autoep_runs.build("mixtral"), route_norm=False, routed_scaling_factor=2.0).module.model.layers[0].mlp
    from dscore.moe.autoep import route

    logits = base.gate(x.reshape(-1, 32))[0]
    w_norm, e_norm = route(logits, base.spec)
    w_raw, e_raw = route(logits, other.spec)
    assert torch.equal(e_norm, e_raw)
    torch.testing.assert_close(w_raw, 2.0 * torch.softmax(logits.float(), -1).gather(1, e_raw))
    torch.testing.assert_close(w_norm * w_norm.new_tensor(1.0), w_raw / w_raw.sum(-1, keepdim=True))
    assert (base.spec.route_norm, other.spec.route_norm, other.spec.route_scale) == (True, False, 2.0)


@pytest.mark.parametrize("score_apply", ["post", "pre"])
def test_block_equals_a_dense_loop_over_experts(score_apply: str) -> None:
    """One converted Qwen2-MoE block (autoep_size 1) against a plain per-token loop over the Hugging Face
    expert tensors: ``post`` weights each expert's output, ``pre`` its input; shared expert and its sigmoid
    gate added."""
    import torch.nn.functional as F

    hf = autoep_runs.build("qwen2_moe")
    block = copy.deepcopy(hf.model.layers[0].mlp)
    layer = _init(hf, score_apply=score_apply).module.model.layers[0].mlp
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(3))
    flat = x.reshape(-1, 32)
    with torch.no_grad():
        probs = torch.softmax(F.linear(flat, block.gate.weight).float(), -1)
        w, e = probs.topk(2, dim=-1)  # norm_topk_prob false in this config
        want = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for j in range(2):
                g = int(e[t, j])
                inp = flat[t] * w[t, j] if score_apply == "pre" else flat[t]
                gate, up = F.linear(inp, block.experts.gate_up_proj[g]).chunk(2)
                out = F.linear(F.silu(gate) * up, block.experts.down_proj[g])
                want[t] += out if score_apply == "pre" else w[t, j] * out
        want += torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
        got = layer(x).reshape(-1, 32)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if score_apply == "post":
        torch.testing.assert_close(got, block(x).reshape(-1, 32), atol=1e-6, rtol=1e-5)


def test_user_parameter_lists_follow_the_replaced_experts() -> None:
    """``model_parameters`` listing the Hugging Face fused expert weights trains the new expert parameters
    (DeepSpeed remaps them too); the experts land in their own optimizer groups."""
    import dscore
    from dscore.moe.autoep import AutoEPMoELayer

    m = autoep_runs.build("mixtral")
    groups = [{"params": list(m.parameters()), "lr": 0.5}]
    engine, *_ = dscore.initialize(model=m, model_parameters=groups, config=autoep_runs.config(0, 1))
    experts = [
        p for mod in engine.module.modules() if isinstance(mod, AutoEPMoELayer) for p in mod.deepspeed_moe.parameters()
    ]
    before = [p.detach().clone() for p in experts]
    ids = autoep_runs.batch(0, 0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert len(experts) == 16 and all(not torch.equal(a, p) for a, p in zip(before, experts))
    assert any(g.get("moe") for g in engine.optimizer.param_groups)


def test_a_custom_layout_by_moe_layer_pattern() -> None:
    """An unknown ``model_type`` needs ``preset_model`` or ``moe_layer_pattern``; the custom preset (softmax,
    renormalised, fused experts, DeepSpeed's ``_build_custom_preset`` defaults) reproduces a Mixtral-layout model."""
    ref = autoep_runs.build("mixtral")
    ref.config.model_type = "my_moe"
    with pytest.raises(ConfigError, match="model_type 'my_moe'"):
        _init(copy.deepcopy(ref))
    engine = _init(copy.deepcopy(ref), moe_layer_pattern=r"model\.layers\.1\.mlp")
    from dscore.moe.autoep import AutoEPMoELayer

    converted = [n for n, mod in engine.module.named_modules() if isinstance(mod, AutoEPMoELayer)]
    assert converted == ["model.layers.1.mlp"]
    assert float((_logits(engine.module) - _logits(ref)).abs().max()) < 1e-5


def test_route_scale_overridden_by_a_routed_scaling_factor_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed's precedence (``routed_scaling_factor``, then ``model.config.routed_scaling_factor``, then
    ``route_scale``) and its warning when a set ``route_scale`` loses: never dropped silently."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dscore.moe.autoep"):
        layer = _init(autoep_runs.build("deepseek_v3"), route_scale=3.0).module.model.layers[1].mlp
    assert layer.spec.route_scale == 1.5  # the model's routed_scaling_factor
    assert "model.config.routed_scaling_factor = 1.5 overrides expert_parallel.route_scale = 3.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscore.moe.autoep"):
        layer = _init(autoep_runs.build("mixtral"), route_scale=3.0).module.model.layers[0].mlp
    assert layer.spec.route_scale == 3.0 and "overrides" not in caplog.text


def test_keys_of_a_disabled_block_are_reported_as_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """``enabled`` false (DeepSpeed's default) with other keys set: nothing is converted and a warning names
    the keys (DeepSpeed drops them silently); a disabled block without other keys says nothing."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dscore.config.expert_parallel"):
        cfg = load_config({"train_batch_size": 2, "expert_parallel": {"autoep_size": 4, "top_k": 2}}, world_size=1)
    assert not cfg.expert_parallel.enabled
    assert "expert_parallel.autoep_size, expert_parallel.top_k are ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscore.config.expert_parallel"):
        load_config({"train_batch_size": 2, "expert_parallel": {"enabled": False}}, world_size=1)
        _load({"autoep_size": 1})
    assert "ignored" not in caplog.text
