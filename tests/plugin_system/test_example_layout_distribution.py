"""Tier 3: a third-party checkpoint layout (examples/plugins/dscore-example-layout) is pip-installed into a
temporary venv, listed by ``dscore plugins list --json``, chosen by ``engine.checkpoint_layout`` for a save on
2 gloo ranks (ZeRO 1: one shard per rank), and auto-detected at load by a fresh single-process engine, which
must hold exactly the saved parameters, optimizer state and counters."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_example_plugin_distribution import _pip, plugin_venv  # noqa: F401 - the shared venv fixture

REPO = Path(__file__).resolve().parents[2]
LAYOUT_SRC = REPO / "examples" / "plugins" / "dscore-example-layout"

pytestmark = pytest.mark.slow

JOB = r'''
import json
import os
import sys

import torch

from dscore.testing import run_distributed

SAVE = sys.argv[1]
CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
          "zero_optimization": {"stage": 1}}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def snapshot(engine):
    params = {k: v.detach().flatten().tolist() for k, v in engine.module_state_dict().items()}
    opt = engine.zero_stage_impl.state_dict()
    moments = {
        f"{name}/{key}": (v.flatten().tolist() if torch.is_tensor(v) else v)
        for name, st in zip(opt["param_names"], [opt["state"][n] for n in opt["param_names"]]) for key, v in st.items()
    } if isinstance(opt.get("state"), dict) and all(n in opt["state"] for n in opt["param_names"]) else opt["state"]
    return {"params": params, "moments": json.loads(json.dumps(moments, default=str)), "steps": engine.global_steps}


def save_job():
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    engine, *_ = dscore.initialize(model=make_model(), config=CONFIG)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 5, generator=g)[rank * 2:(rank + 1) * 2]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.checkpoint_layout = "sharded"
    engine.save_checkpoint(SAVE, client_state={"note": "hi"})
    out = snapshot(engine)
    engine.close()
    return out


if __name__ == "__main__":
    saved = run_distributed(save_job, 2, timeout=240)
    import dscore

    engine, *_ = dscore.initialize(model=torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)),
                                   config={**CONFIG, "train_batch_size": 2})
    before = snapshot(engine)
    path, client = engine.load_checkpoint(SAVE)  # no layout named: detected
    loaded = snapshot(engine)
    tag_dir = os.path.join(SAVE, "global_step2")
    print(json.dumps({"saved": saved, "before": before, "loaded": loaded, "client": client, "path": path,
                      "files": sorted(os.listdir(tag_dir)), "manifest": json.load(open(os.path.join(tag_dir, "_COMPLETE")))}))
'''


def test_third_party_layout_saves_and_is_detected_at_load(plugin_venv: Path, tmp_path: Path) -> None:  # noqa: F811
    py = plugin_venv
    src = tmp_path / "dscore-example-layout"
    shutil.copytree(LAYOUT_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip(py, "install", "--no-deps", "--no-build-isolation", str(src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        listed = subprocess.run(
            [py, "-m", "dscore", "plugins", "list", "--json"], capture_output=True, text=True, timeout=120
        )
        assert listed.returncode == 0, listed.stderr
        rows = {r["name"]: r for r in json.loads(listed.stdout)}
        row = rows["example_layout"]
        assert row["status"] == "active" and row["builtin"] is False, row
        assert row["provides"] == {"checkpoint_layout": ["sharded"]}
        assert rows["checkpoint"]["provides"]["checkpoint_layout"] == ["deepspeed", "dscore"]

        job = tmp_path / "layout_example_job.py"
        job.write_text(JOB)
        save = tmp_path / "ckpt"
        run = subprocess.run([py, str(job), str(save)], capture_output=True, text=True, timeout=400, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        _pip(py, "uninstall", "-y", "dscore-example-layout")

    # the layout's own files (one shard per rank, its manifest), published by dscore's protocol
    assert out["files"] == ["_COMPLETE", "shard_00000.safetensors", "shard_00001.safetensors", "sharded_manifest.json"]
    assert out["manifest"]["layout"] == "sharded" and out["manifest"]["world_size"] == 2
    assert out["path"].endswith("sharded_manifest.json") and out["client"] == {"note": "hi"}
    saved = out["saved"][0]
    assert out["saved"][1]["params"] == saved["params"]  # the ranks agree
    assert out["before"]["params"] != saved["params"]  # the fresh engine really changed at load
    assert out["loaded"]["params"] == saved["params"]
    assert out["loaded"]["moments"] == saved["moments"]
    assert out["loaded"]["steps"] == saved["steps"] == 2
