"""Single-process parts of AutoTP and Ulysses: config validation, the split plan and its strict errors,
the mesh layout, TiledMLP / sequence_tiled_compute against the untiled computation, and `config check`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from tp_sp_model import MLP, TinyLlama  # noqa: E402

from dscore.config import load_config  # noqa: E402
from dscore.config.parallel import TensorParallelConfig  # noqa: E402
from dscore.errors import ConfigError  # noqa: E402
from dscore.parallel.autotp import plan_autotp  # noqa: E402
from dscore.parallel.mesh import MeshShape  # noqa: E402
from dscore.parallel.ulysses import TiledMLP, sequence_tiled_compute  # noqa: E402


def test_mesh_layout_tensor_fastest_then_sequence_then_data() -> None:
    shape = MeshShape.of(8, tp=2, sp=2)
    assert shape.dp == 2
    assert shape.tp_ranks(5) == [4, 5]
    assert shape.sp_ranks(5) == [5, 7]
    assert shape.dp_ranks(5) == [1, 5]
    assert shape.grad_ranks(5) == [1, 3, 5, 7]
    assert shape.coords(6) == (1, 1, 0)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        MeshShape.of(6, tp=2, sp=2)


def test_batch_triangle_uses_data_parallel_size() -> None:
    cfg = load_config(
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}},
        world_size=2,
    )
    assert cfg.gradient_accumulation_steps == 2 and cfg.tensor_parallel.size == 2


@pytest.mark.parametrize(
    "block, message",
    [
        ({"autotp_size": 2, "tp_overlap_comm": True}, "tp_overlap_comm"),
        ({"autotp_size": 2, "preset_model": "bloom"}, "preset_model 'bloom'"),
        (
            {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["("]}]}},
            "not a valid regular expression",
        ),
        (
            {
                "autotp_size": 2,
                "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]},
            },
            "partition_type",
        ),
        ({"autotp_size": 2, "vocab_parallel_lm_head": True}, "vocab_parallel_lm_head"),
        ({"autotp_size": 2, "bogus": 1}, "bogus"),
    ],
)
def test_tensor_parallel_block_refuses_what_dscore_cannot_honour(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 2, "tensor_parallel": block}, world_size=1)


def test_plan_priority_config_then_hf_plan_then_builtin_parser() -> None:
    model = TinyLlama()
    plan = plan_autotp(model, TensorParallelConfig(autotp_size=2))
    assert plan["layers.0.self_attn.q_proj"].kind == "column" and plan["layers.1.mlp.down_proj"].kind == "row"
    assert plan["lm_head"].gather_output and plan["embed_tokens"].kind == "embedding"
    # a Hugging Face plan beats the parser; the config beats the plan
    model._tp_plan = {"layers.*.mlp.up_proj": "rowwise"}  # type: ignore[assignment]
    assert plan_autotp(model, TensorParallelConfig(autotp_size=2))["layers.0.mlp.up_proj"].kind == "row"
    cfg = TensorParallelConfig.model_validate(
        {
            "autotp_size": 2,
            "partition_config": {"layer_specs": [{"patterns": [r".*\.up_proj\.weight$"], "partition_type": "skip"}]},
        }
    )
    plan = plan_autotp(model, cfg)
    assert "layers.0.mlp.up_proj" not in plan and plan["layers.0.mlp.gate_proj"].source == "the built-in parser"


def test_plan_errors_name_the_patterns() -> None:
    cfg = TensorParallelConfig.model_validate(
        {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": [r".*\.qkv\.weight$"]}]}}
    )
    with pytest.raises(ConfigError, match=r"qkv.*matched no parameter"):
        plan_autotp(TinyLlama(), cfg)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="no layer of Sequential would be split.*built-in parser"):
        plan_autotp(net, TensorParallelConfig(autotp_size=2))


def test_tied_weights_stay_whole_or_are_refused() -> None:
    model = TinyLlama()
    model.lm_head.weight = model.embed_tokens.weight  # tie_word_embeddings
    plan = plan_autotp(model, TensorParallelConfig(autotp_size=2))
    assert "lm_head" not in plan and "embed_tokens" not in plan and "layers.0.mlp.up_proj" in plan
    cfg = TensorParallelConfig.model_validate(
        {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["lm_head"], "partition_type": "column"}]}}
    )
    with pytest.raises(ConfigError, match="tied to embed_tokens.weight, lm_head.weight"):
        plan_autotp(model, cfg)


def _mlp_fn(module: MLP, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_tiled_mlp_equals_plain_mlp_bit_for_bit() -> None:
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(2, 64, 32, requires_grad=True)
    plain = mlp(x)
    plain.square().sum().backward()
    ref_x, ref_p = x.grad.clone(), {n: p.grad.clone() for n, p in mlp.named_parameters()}
    x.grad = None
    mlp.zero_grad()
    tiled = TiledMLP.apply(_mlp_fn, mlp, x, 4)
    assert torch.equal(tiled, plain)
    tiled.square().sum().backward()
    assert torch.equal(x.grad, ref_x)
    for n, p in mlp.named_parameters():  # sums over 4 tiles: equal up to float addition order
        assert torch.allclose(p.grad, ref_p[n], rtol=1e-5, atol=1e-5), n


def test_sequence_tiled_compute_loss_equals_full_loss() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40)
    h = torch.randn(2, 32, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 32))

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(hidden).reshape(-1, 40), labels.reshape(-1))

    full = loss_fn(h, labels)
    full.backward()
    ref_h, ref_w = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad, head.bias.grad = None, None, None
    tiled = sequence_tiled_compute(
        loss_fn, 32, 4, {"hidden": h, "labels": labels}, {}, "hidden", compute_params=list(head.parameters())
    )
    assert torch.allclose(tiled, full, atol=1e-6)
    tiled.backward()
    assert torch.allclose(h.grad, ref_h, atol=1e-7) and torch.allclose(head.weight.grad, ref_w, atol=1e-6)


def test_config_check_accepts_tensor_and_sequence_parallel(tmp_path: Path) -> None:
    from dscore.cli.main import main

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2})
    )
    assert main(["config", "check", str(path), "--world-size", "4"]) == 0


def test_autotp_accepts_fp16_and_refuses_a_disagreeing_dtype() -> None:
    from dscore.parallel.autotp import check_tp_config

    cfg = load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, "dtype": "bf16"}}, world_size=1)
    with pytest.raises(ConfigError, match="tensor_parallel.dtype = 'bf16' but the precision mode is fp32"):
        check_tp_config(cfg, precision_name="fp32")
    check_tp_config(cfg, precision_name="bf16")
    with pytest.raises(ConfigError, match="tensor_parallel.dtype = 'bf16' but the precision mode is fp16"):
        check_tp_config(cfg, precision_name="fp16")
    # fp16 itself is fine: the overflow verdict is the whole model's (TensorParallelStage.model_norm_sq)
    plain = load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}}, world_size=1)
    check_tp_config(plain, precision_name="fp16")
