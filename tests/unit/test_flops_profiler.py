"""The flops profiler: exact counts against hand formulas and DeepSpeed 0.19.8's output, the report's
layout, and the ``flops_profiler`` block driving it inside a training run."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dscore
from dscore.errors import ConfigError
from dscore.profiling.flops_profiler import FlopsProfiler, FlopsProfilerError, get_model_profile

DATA = Path(__file__).parent / "data"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(100, 16), nn.LayerNorm(16), nn.Linear(16, 100, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids))
        return torch.matmul(h, self.head.weight.t()) + torch.add(h.sum(-1, keepdim=True), 1.0)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 4, 3, stride=2, groups=4, bias=False)
        self.gn, self.pool = nn.GroupNorm(2, 4), nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.gn(self.c2(F.gelu(self.bn(self.c1(x))))))


def _profile(model: nn.Module, *args: torch.Tensor) -> tuple[int, int, int]:
    return get_model_profile(model, args=list(args), print_profile=False, as_string=False)


def test_mlp_matches_deepspeed_counts() -> None:
    torch.manual_seed(0)
    flops, macs, params = _profile(MLP(), torch.randn(8, 64))
    assert params == 64 * 128 + 128 + 128 * 32 + 32 == 12_448
    assert macs == 8 * 64 * 128 + 8 * 128 * 32 == 98_304
    assert flops == 2 * macs + 8 * 128 == 197_632  # linear 2*MACs (bias not counted), ReLU 1 per element
    assert get_model_profile(MLP(), args=[torch.randn(8, 64)], print_profile=False) == (
        "197.63 K",
        "98.3 KMACs",
        "12.45 K",
    )


def test_attention_layer_norm_sdpa_hand_counts() -> None:
    b, t, d, h = 2, 10, 32, 4
    flops, macs, params = _profile(Attention(d, h), torch.randn(b, t, d))
    ln = 5 * b * t * d  # affine layer norm: 5 per element
    qkv_macs, out_macs = b * t * d * 3 * d, b * t * d * d
    hd = d // h
    sdpa_macs = (b * h * t * hd) * t + (b * h * t) * t * hd  # q·kᵀ plus attn·v (is_causal does not discount)
    assert macs == qkv_macs + out_macs + sdpa_macs == 94_720
    assert flops == ln + 2 * (qkv_macs + out_macs) + 2 * sdpa_macs == 192_640
    assert params == 2 * d + 3 * d * d + 3 * d + d * d + d == 4_288


def test_embedding_matmul_add_hand_counts() -> None:
    b, t, d, vocab = 4, 7, 16, 100
    flops, macs, params = _profile(Embed(), torch.randint(0, vocab, (b, t)))
    mm = b * t * d * vocab  # torch.matmul counted; embedding 0; the "+" operator is not counted (as DeepSpeed)
    assert macs == mm == 44_800
    assert flops == 5 * b * t * d + 2 * mm + b * t == 91_868  # layer norm, matmul, torch.add over [b, t, 1]
    assert params == vocab * d + 2 * d + vocab * d == 3_232


def test_conv_norm_pool_hand_counts() -> None:
    n, hw = 2, 16
    flops, macs, params = _profile(Conv().eval(), torch.randn(n, 3, hw, hw))
    c1_macs = 3 * 3 * 3 * 8 * (n * hw * hw)  # kernel · in · out/groups · positions
    c2_out = (hw + 0 - 3) // 2 + 1
    c2_macs = 3 * 3 * 8 * (4 // 4) * (n * c2_out * c2_out)
    c1_flops = 2 * c1_macs + 8 * n * hw * hw  # bias: out_channels per position
    bn_eval = 2 * n * 8 * hw * hw  # eval-mode affine batch norm: 2 per element
    gelu = n * 8 * hw * hw
    gn = 5 * n * 4 * c2_out * c2_out
    pool = n * 4 * c2_out * c2_out  # input elements
    assert macs == c1_macs + c2_macs == 117_648
    assert flops == c1_flops + bn_eval + gelu + 2 * c2_macs + gn + pool == 254_032
    assert params == (3 * 9 * 8 + 8) + 16 + (2 * 9 * 4) + 8 == 320


def _masked(text: str) -> str:
    text = re.sub(r"[0-9.]+ [mu]?s\b", "<T>", text)
    text = re.sub(r"[0-9.]+ [KMGT]?FLOPS", "<R>", text)
    return re.sub(r"[0-9.]+% latency", "<P>% latency", text)


def test_report_is_deepspeeds_layout(tmp_path: Path) -> None:
    """The whole report equals DeepSpeed 0.19.8's for the MLP (latencies masked), via output_file."""
    torch.manual_seed(0)
    out = tmp_path / "sub" / "profile.txt"
    get_model_profile(MLP(), args=[torch.randn(8, 64)], output_file=str(out))
    assert _masked(out.read_text()) == (DATA / "flops_profile_mlp_deepspeed_0.19.8.txt").read_text()


def test_functions_restored_and_nested_profiles_refused() -> None:
    linear, matmul = F.linear, torch.Tensor.__matmul__
    model = MLP()
    first, second = FlopsProfiler(model), FlopsProfiler(MLP())
    first.start_profile()
    assert F.linear is not linear
    with pytest.raises(FlopsProfilerError, match="another FlopsProfiler"):
        second.start_profile()
    model(torch.randn(2, 64))
    first.stop_profile()
    assert F.linear is linear and torch.Tensor.__matmul__ is matmul
    assert first.get_total_macs() == 2 * 64 * 128 + 2 * 128 * 32  # readable after stop
    first.end_profile()
    with pytest.raises(FlopsProfilerError, match="no profile"):
        first.get_total_flops()
    second.start_profile()  # the first released the patches
    second.end_profile()


def _engine_config(tmp_path: Path, **block: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "output_file": str(tmp_path / "flops.txt"), **block},
    }


def test_engine_profiles_the_configured_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    cfg = _engine_config(tmp_path, profile_step=2, module_depth=-1, top_modules=2, detailed=False)
    engine, *_ = dscore.initialize(model=model, config=cfg)
    assert engine.wall_clock_breakdown()  # forced on, as DeepSpeed does
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        x, y = torch.randn(8, 64), torch.randn(8, 32)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        F.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert (tmp_path / "flops.txt").exists() == (step >= 2)
    text = (tmp_path / "flops.txt").read_text()
    assert "Profile Summary at step 3:" in text  # DeepSpeed prints global_steps after the step
    assert re.search(r"world size: +1 ", text) and re.search(r"batch size per GPU: +8 ", text)
    assert re.search(r"fwd MACs per GPU: +98.3 KMACs", text)
    assert re.search(r"fwd flops per GPU: +197.63 K", text)
    assert re.search(r"params of model = params per GPU \* mp_size: +12.45 K", text)
    assert re.search(r"bwd FLOPS per GPU = 2 \* fwd flops", text) and "step latency:" in text
    assert "Top 2 modules" in text and "Detailed Profile" not in text  # top_modules and detailed read
    assert not engine._forward_hooks and not engine._forward_pre_hooks  # removed after the report
    assert F.linear.__module__ != __name__ and not hasattr(F.linear, "__wrapped__")
    for p, q in zip(engine.module.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # profiling changes nothing
    engine.close()


def test_engine_recompute_factor_and_config_checks(tmp_path: Path) -> None:
    cfg = _engine_config(tmp_path, profile_step=0, recompute_fwd_factor=1.0)
    engine, *_ = dscore.initialize(model=MLP(), config=cfg)
    engine.backward(F.mse_loss(engine(torch.randn(8, 64)), torch.randn(8, 32)))
    engine.step()
    text = (tmp_path / "flops.txt").read_text()
    assert "Profile Summary at step 1:" in text and "bwd FLOPS per GPU = 3 * fwd flops" in text
    engine.close()
    for bad in ({"module_depth": -2}, {"top_modules": 0}, {"profile_stepp": 1}):
        with pytest.raises(ConfigError, match="flops_profiler"):
            dscore.initialize(model=MLP(), config=_engine_config(tmp_path, **bad))


def test_engine_profile_under_zero3_counts_partitioned_parameters(tmp_path: Path) -> None:
    cfg = _engine_config(tmp_path, profile_step=0, detailed=False)
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = dscore.initialize(model=MLP(), config=cfg)
    engine.backward(F.mse_loss(engine(torch.randn(8, 64)), torch.randn(8, 32)))
    engine.step()
    text = (tmp_path / "flops.txt").read_text()
    engine.close()
    assert re.search(r"params per GPU: +12.45 K", text)  # full sizes, though partitioned between gathers
    assert re.search(r"fwd MACs per GPU: +98.3 KMACs", text)


def test_public_names_are_the_profiling_plugins_and_disabling_it_names_it() -> None:
    """dscore.profiling.flops_profiler and deepspeed.profiling.flops_profiler re-export the plugin's objects;
    with the plugin disabled, importing a name raises the registry's error naming it (no silent fallback)."""
    import subprocess
    import sys

    import dscore.profiling.flops_profiler as public
    from dscore_plugins.profiling import model_profile, profiler

    assert public.FlopsProfiler is profiler.FlopsProfiler is FlopsProfiler
    assert public.get_model_profile is model_profile.get_model_profile is get_model_profile
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        public.NotAName  # noqa: B018
    code = (
        "import os\n"
        "from dscore.errors import ComponentNotFoundError\n"
        "for name in ('dscore.profiling.flops_profiler', 'deepspeed.profiling.flops_profiler'):\n"
        "    try:\n"
        "        exec(f'from {name} import get_model_profile')\n"
        "    except ComponentNotFoundError as exc:\n"
        "        print('refused', exc)\n"
        "    else:\n"
        "        print('imported')\n"
    )
    for disable in ("profiling", "config_section:flops_profiler"):
        env = {**os.environ, "DSCORE_DISABLE_PLUGINS": disable}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 2 and all(line.startswith("refused") for line in lines), proc.stdout
        assert "flops_profiler" in lines[0] and disable.split(":")[0] in lines[0]
