"""The main job, shortened: 2 ranks through `dscore run`, save, resume without repeating steps, and an
interrupted run (SIGINT to the launcher) that resumes from its last checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SMALL = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "64", "--eval_batches", "2",
         "--log_interval", "4", "--sample_bytes", "40"]


def _cmd(ckpt: Path, steps: int, save_interval: int, *extra: str) -> list[str]:
    dscore = str(Path(sys.executable).with_name("dscore"))
    gpt = REPO / "examples" / "gpt"
    return [dscore, "run", "--num_gpus", "2", str(gpt / "train.py"), "--deepspeed_config", str(gpt / "ds_config.json"),
            "--steps", str(steps), "--save_interval", str(save_interval), "--eval_interval", str(save_interval),
            "--checkpoint_dir", str(ckpt), *SMALL, *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _steps_logged(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step\s+(\d+)/", out, flags=re.M)]


def test_train_save_resume_sample(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = subprocess.run(_cmd(ckpt, 12, 6), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert _steps_logged(first.stdout) == [4, 8, 12]
    assert "validation loss" in first.stdout and "unigram baseline" in first.stdout
    assert "----- sample -----" in first.stdout
    assert (ckpt / "latest").read_text().strip() == "global_step12"

    second = subprocess.run(_cmd(ckpt, 20, 6), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout and "at step 12" in second.stdout
    assert _steps_logged(second.stdout) == [16, 20], "a resumed run must not repeat finished steps"
    # the loss keeps falling across the resume
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", first.stdout + second.stdout)]
    assert losses[-1] < losses[0]


def test_ctrl_c_then_rerun_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(_cmd(ckpt, 400, 4), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (ckpt / "latest").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted: saved step" in out, out
    saved = int((ckpt / "latest").read_text().strip().removeprefix("global_step"))
    assert f"interrupted: saved step {saved} " in out  # the stop itself saved: no finished step is lost

    again = subprocess.run(_cmd(ckpt, saved + 4, 4), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"at step {saved}" in again.stdout
    logged = _steps_logged(again.stdout)
    assert logged and all(s > saved for s in logged) and logged[-1] == saved + 4, logged
