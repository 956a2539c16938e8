"""``examples/gpt/train.py --pipeline-stages 2`` under ``dscore run --num_gpus 2``: the GPT trains as a
2-stage pipeline, saves per-layer checkpoints, and the closing sample comes from a plain GPT loaded out
of the pipeline checkpoint (loading is checked against a reference in test_pipeline_distributed.py)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dscore.testing.distributed import find_free_port

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
SMALL = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--eval_batches", "2",
         "--sample_bytes", "16", "--log_interval", "1", "--save_interval", "2", "--eval_interval", "2"]

pytestmark = pytest.mark.slow


def _launch(cwd: Path, *argv: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = Path(sys.executable).with_name("dscore")
    for _ in range(3):
        cmd = [str(script), "run", "--num_gpus", "2", "--master_port", str(find_free_port()), str(GPT), *argv]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or not re.search(r"EADDRINUSE|address already in use", out, re.I):
            break
    assert proc.returncode == 0, out[-6000:]
    return proc.stdout


def test_gpt_trains_as_two_stage_pipeline(tmp_path: Path) -> None:
    rng = random.Random(0)
    (tmp_path / "t.txt").write_text("".join(rng.choice("abcdefgh \n") for _ in range(20000)))
    common = ["--data", "t.txt", "--checkpoint_dir", "ck", "--pipeline-stages", "2", *SMALL]
    out = _launch(tmp_path, "--steps", "2", *common)
    assert out.count("pipeline: 2 stages x 1 data-parallel") == 1
    assert "ds_config adapted: ZeRO stage 2 -> 1" in out  # the example's config uses stage 2 + offload
    assert re.search(r"^step +2/2 \| loss [0-9.]+", out, re.M)
    names = sorted(p.name for p in (tmp_path / "ck" / "global_step2").iterdir())
    n_layers = 2 + 3  # stem, 2 blocks, final LayerNorm, tied head
    assert [n for n in names if n.startswith("layer_")] == [f"layer_{i:02d}-model_states.pt" for i in range(n_layers)]
    assert "----- sample -----" in out
