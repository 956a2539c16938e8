"""Tier 3: a third-party ZeRO stage (examples/plugins/dscore-example-zero) is pip-installed into a temporary
venv, selected by ``zero_optimization.implementation``, and trained on 2 real gloo ranks: it must give the
built-in stage 2's numbers (fp32) and match a plain single-process PyTorch reference."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_example_plugin_distribution import _pip, plugin_venv  # noqa: F401 - the shared venv fixture

REPO = Path(__file__).resolve().parents[2]
ZERO_SRC = REPO / "examples" / "plugins" / "dscore-example-zero"

pytestmark = pytest.mark.slow

JOB = r'''
import json
import sys

import torch
import torch.nn.functional as F

from dscore.testing import run_distributed

STEPS, WORLD, PER_RANK, LR, CLIP = 4, 2, 3, 0.05, 0.5


def make_model():
    torch.manual_seed(0)
    # uneven sizes (none divisible by the world size) and several parameters per bucket
    return torch.nn.Sequential(
        torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    )


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * PER_RANK, 5, generator=g), torch.randn(WORLD * PER_RANK, 3, generator=g))
            for _ in range(STEPS)]


def train(zero_extra, extra):
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    config = {
        "train_batch_size": WORLD * PER_RANK,
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 40, "overlap_comm": True, **zero_extra},
        **extra,
    }
    engine, *_ = dscore.initialize(model=make_model(), config=config)
    losses = []
    for x, y in batches():
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = F.mse_loss(engine(x[part]), y[part])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {k: v.detach().flatten().tolist() for k, v in engine.module_state_dict().items()}
    impl = f"{type(engine.zero_stage_impl).__module__}.{type(engine.zero_stage_impl).__name__}"
    engine.close()
    return {"impl": impl, "losses": losses, "params": params}


def job():
    return {
        "builtin": train({}, {}),
        "example": train({"implementation": "count_bucket_stage2"}, {"example_zero": {"params_per_bucket": 2}}),
    }


def reference():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for x, y in batches():
        F.mse_loss(model(x), y).backward()  # equal halves: the mean of the ranks' losses
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().flatten().tolist() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    ranks = run_distributed(job, WORLD, timeout=240)
    print(json.dumps({"ranks": ranks, "reference": reference()}))
'''


def test_third_party_zero_stage_trains_like_builtin_stage_2(plugin_venv: Path, tmp_path: Path) -> None:  # noqa: F811
    py = plugin_venv
    src = tmp_path / "dscore-example-zero"
    shutil.copytree(ZERO_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip(py, "install", "--no-deps", "--no-build-isolation", str(src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        listed = subprocess.run(
            [py, "-m", "dscore", "plugins", "list", "--json"], capture_output=True, text=True, timeout=120
        )
        assert listed.returncode == 0, listed.stderr
        row = {r["name"]: r for r in json.loads(listed.stdout)}["example_zero"]
        assert row["status"] == "active" and row["builtin"] is False, row
        assert row["provides"]["zero_stage"] == ["count_bucket_stage2"]

        job = tmp_path / "zero_example_job.py"
        job.write_text(JOB)
        run = subprocess.run([py, str(job)], capture_output=True, text=True, timeout=400, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        _pip(py, "uninstall", "-y", "dscore-example-zero")

    ref = out["reference"]
    for rank, res in enumerate(out["ranks"]):
        builtin, example = res["builtin"], res["example"]
        assert builtin["impl"] == "dscore_plugins.zero.stage2.Stage2"
        assert example["impl"] == "dscore_example_zero.stage.CountBucketStage2"
        # same losses and weights as the built-in stage 2 (fp32; only the global-norm summation order differs)
        assert example["losses"] == pytest.approx(builtin["losses"], rel=1e-6, abs=1e-7), rank
        for name, want in builtin["params"].items():
            assert example["params"][name] == pytest.approx(want, rel=1e-6, abs=1e-6), (rank, name)
            # and both match plain PyTorch on the concatenated batch
            assert example["params"][name] == pytest.approx(ref[name], rel=1e-4, abs=2e-5), (rank, name)
    assert out["ranks"][0]["example"]["params"] == out["ranks"][1]["example"]["params"]  # ranks agree exactly
