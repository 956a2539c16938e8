"""Every example, and the README's script template, runs as its docstring / the README says, both as a
plain ``python`` process and under ``dscore run --num_gpus 2`` (which passes ``--local_rank=N``).

Runs are kept tiny through the examples' own options (one epoch, a few steps, a small model, a small
text file), from a temp working directory so nothing lands in the checkout. ``--master_port`` is a free
port (the launcher's default 29500 could be taken by another run); a lost race for it is retried.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dscore.testing.distributed import find_free_port

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp" / "train.py"
GPT = REPO / "examples" / "gpt" / "train.py"
GRPO = REPO / "examples" / "rlhf" / "grpo.py"
GPT_SMALL = ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--eval_batches", "1",
             "--sample_bytes", "16"]
TIMEOUT_S = 600  # a hang guard only; these runs take seconds

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
            "DS_ACCELERATOR", "DS_ENV_FILE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _dscore() -> list[str]:
    """The ``dscore`` console script next to this interpreter (what an activated .venv puts on PATH)."""
    script = Path(sys.executable).with_name("dscore")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dscore"]


def plain(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python <argv>`` in ``cwd``."""
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def launched(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``dscore run --num_gpus 2 <argv>`` in ``cwd`` on a free port (retried when another process took it)."""
    for _attempt in range(3):
        cmd = [*_dscore(), "run", "--num_gpus", "2", "--master_port", str(find_free_port()), *argv]
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode == 0 or not re.search(r"EADDRINUSE|address already in use", proc.stdout + proc.stderr, re.I):
            return proc
    return proc


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "unrecognized arguments" not in out
    return proc.stdout


# ------------------------------------------------------------------------------------------------ MLP
def _accuracy(stdout: str) -> tuple[int, float]:
    found = re.findall(r"^steps: (\d+)  held-out accuracy: ([0-9.]+)$", stdout, flags=re.M)
    assert len(found) == 1, stdout[-2000:]  # printed once, by rank 0
    return int(found[0][0]), float(found[0][1])


def test_mlp_plain_python(tmp_path: Path) -> None:
    steps, accuracy = _accuracy(_ok(plain(tmp_path, str(MLP), "--epochs", "1")))
    assert steps == 45  # ceil(1437 training images / micro batch 32)
    assert accuracy > 0.3  # chance is 0.1


def test_mlp_under_dscore_run(tmp_path: Path) -> None:
    steps, accuracy = _accuracy(_ok(launched(tmp_path, str(MLP), "--epochs", "1")))
    assert steps == 23  # each of the 2 ranks trains on half of the images
    assert 0.0 < accuracy <= 1.0


# ------------------------------------------------------------------------------------------------ GPT
@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """~60 kB of text, enough for the example's train/validation split of a single file."""
    words = (REPO / "README.md").read_text().split()
    path = tmp_path / "text.txt"
    path.write_text(" ".join(words[(i * 7919) % len(words)] for i in range(9000)))
    return path


def _final_lr(stdout: str, step: int) -> float:
    line = re.search(rf"^step\s+{step}/{step} \| loss [0-9.]+ \| lr ([0-9.e+-]+) \|", stdout, flags=re.M)
    assert line, stdout[-2000:]
    return float(line.group(1))


def test_gpt_plain_python_fits_schedule_and_logs_saves(tmp_path: Path, text_file: Path) -> None:
    out = _ok(plain(tmp_path, str(GPT), "--steps", "3", "--log_interval", "1", "--save_interval", "2",
                    "--data", str(text_file), "--checkpoint_dir", "ck", *GPT_SMALL))
    assert "world size 1" in out
    # ds_config says total 400 / warm-up 40; --steps 3 makes it 3 / 1, so the run ends at the minimum lr
    assert "lr schedule: WarmupCosineLR over 3 steps, 1 of them warm-up (fitted to --steps" in out
    ds = json.loads((REPO / "examples" / "gpt" / "ds_config.json").read_text())
    lr, floor = ds["optimizer"]["params"]["lr"], ds["scheduler"]["params"]["cos_min_ratio"]
    assert _final_lr(out, 3) == pytest.approx(lr * floor, rel=1e-2)
    saves = re.findall(r"^saved checkpoint (\S+) \([0-9.]+ s\)$", out, flags=re.M)
    assert saves == [str(Path("ck") / "global_step2"), str(Path("ck") / "global_step3")]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step3"
    assert re.search(r"validation loss [0-9.]+ nats/byte, \d+% (below|above) the unigram baseline of [0-9.]+$", out, re.M)
    assert "----- sample -----" in out


def test_gpt_under_dscore_run_no_resume_clears_only_old_checkpoints(tmp_path: Path, text_file: Path) -> None:
    ckpt = tmp_path / "ck"
    (ckpt / "global_step99").mkdir(parents=True)
    (ckpt / "global_step99" / "model_states.safetensors").write_bytes(b"old run")
    (ckpt / ".global_step100.tmp-abc").mkdir()
    (ckpt / "latest").write_text("global_step99")
    (ckpt / "notes.txt").write_text("mine")
    (ckpt / "global_step_best").mkdir()  # not a name this script saves under: kept
    proc = launched(tmp_path, str(GPT), "--deepspeed_config", str(GPT.with_name("ds_config.json")), "--steps", "4",
                    "--log_interval", "2", "--save_interval", "2", "--eval_interval", "4", "--data", str(text_file),
                    "--checkpoint_dir", str(ckpt), "--no-resume", *GPT_SMALL)
    out = _ok(proc)
    assert "world size 2" in out
    assert out.count("lr schedule: WarmupCosineLR over 4 steps") == 1  # rank 0 only
    assert "--no-resume: deleted the earlier checkpoints" in out and "global_step99" in out
    assert "resumed from" not in out
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "global_step4", "global_step_best", "latest", "notes.txt"]
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    saves = re.findall(r"^saved checkpoint (\S+) \(", out, flags=re.M)
    assert saves == [str(ckpt / "global_step2"), str(ckpt / "global_step4")]  # each save logged once
    ds = json.loads(GPT.with_name("ds_config.json").read_text())
    assert _final_lr(out, 4) == pytest.approx(ds["optimizer"]["params"]["lr"] * ds["scheduler"]["params"]["cos_min_ratio"], rel=1e-2)


def test_gpt_help_under_dscore_run_prints_once(tmp_path: Path) -> None:
    proc = launched(tmp_path, str(GPT), "--help")
    out = _ok(proc)
    assert out.count("usage:") == 1 and "--no-resume" in out and "--local_rank" in out
    bad = launched(tmp_path, str(GPT), "--steps", "0")
    assert bad.returncode == 2
    assert (bad.stdout + bad.stderr).count("--steps must be at least 1") == 1


# ------------------------------------------------------------------------------------ README template
PRELUDE = '''
import torch

class MyModel(torch.nn.Module):
    """y = w.x + b; forward(batch) returns the mean squared error of a (x, y) batch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

torch.manual_seed(0)
_x = torch.randn(64, 4)
my_dataset = torch.utils.data.TensorDataset(_x, _x @ torch.tensor([1.0, -2.0, 0.5, 3.0]))
'''
EPILOGUE = '''
if engine.global_rank == 0:
    print(f"TEMPLATE-DONE steps={engine.global_steps} resumed={path is not None}")
'''


def _readme_template() -> str:
    """The first python block of the README's "Using dscore from a training script" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Using dscore from a training script", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert block, "the README's training-script section has no python block"
    return block.group(1)


@pytest.fixture
def template(tmp_path: Path) -> Path:
    code = _readme_template()
    assert "dscore.add_config_arguments(parser)" in code and "dscore.initialize(" in code
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + code + EPILOGUE)
    (tmp_path / "ds_config.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
    }))
    return script


@pytest.mark.parametrize("how", ["python", "dscore run --num_gpus 2"])
def test_readme_template(template: Path, how: str) -> None:
    argv = [str(template), "--deepspeed_config", "ds_config.json"]
    proc = plain(template.parent, *argv) if how == "python" else launched(template.parent, *argv)
    out = _ok(proc)
    steps = 64 // 8 if how == "python" else 64 // 8 // 2
    assert out.count("TEMPLATE-DONE") == 1 and f"TEMPLATE-DONE steps={steps} resumed=True" in out
    assert (template.parent / "ckpts" / "latest").read_text().strip() == f"global_step{steps}"


# ------------------------------------------------------------------------------------------------ RLHF (GRPO)
def test_grpo_under_dscore_run_raises_the_reward(tmp_path: Path) -> None:
    """12 GRPO steps on 2 ranks (hybrid engine, ZeRO-3, a frozen ZeRO-3 reference): the mean reward of the last
    3 steps is well above the first 3 (seeded: the same numbers every run; 0.08 -> 0.46 here)."""
    proc = launched(tmp_path, str(GRPO), "--deepspeed_config", str(GRPO.with_name("ds_config.json")), "--steps", "12",
                    "--log_interval", "1")
    out = _ok(proc)
    assert "ZeRO stage 3; world size 2" in out
    rows = re.findall(r"^step\s+(\d+)/12 \| reward ([0-9.]+) \| kl ([0-9.]+) \| loss ([+-][0-9.]+) \|", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, 13)), out[-3000:]  # one line per step, rank 0 only
    rewards = [float(r[1]) for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
    assert float(rows[-1][2]) > 10 * float(rows[0][2]) > 0  # the policy starts at the reference and moves away
    assert out.count("summary: 12 steps") == 1


def test_grpo_trl_path_under_dscore_run(tmp_path: Path) -> None:
    """``--trl``: TRL's GRPOTrainer builds dscore's ZeRO-3 engine through compat ``deepspeed`` and trains 2 steps;
    ``--trl --beta 0.1`` is refused by rank 0 (TRL's reference would be loaded by from_pretrained)."""
    pytest.importorskip("trl")
    out = _ok(launched(tmp_path, str(GRPO), "--trl", "--steps", "2", "--log_interval", "1"))
    assert out.count("TRL GRPOTrainer: engine dscore.runtime.engine.DscoreEngine from `deepspeed` (dscore's layer: "
                     "True), ZeRO stage 3") == 1
    assert re.search(r"^step\s+1/2 \| reward [0-9.]+ \|", out, re.M), out[-3000:]
    assert out.count("summary (TRL): 2 steps") == 1
    bad = launched(tmp_path, str(GRPO), "--trl", "--beta", "0.1")
    assert bad.returncode == 2 and (bad.stdout + bad.stderr).count("--trl runs without a reference model") == 1
