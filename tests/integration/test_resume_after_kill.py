"""A save killed with SIGKILL at any point leaves the previous checkpoint and ``latest`` usable.

A child process trains, saves ``global_step2``, trains on and starts saving ``global_step4``; at a chosen
point inside that save it signals the test and waits, and the test kills it with SIGKILL. The test then
resumes from ``latest`` (which must still be ``global_step2`` and hold the child's step-2 state), trains,
and saves ``global_step4`` again, which must succeed and clean up what the killed save left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import dscore
from dscore.persistence import savedir as L
from dscore.persistence.tensorfile import read_tensor_file
from dscore.testing import find_free_port

pytestmark = pytest.mark.slow

CHILD = r"""
import json, os, sys, time
import torch
import dscore
from dscore.persistence import savedir as _layout, tensorfile as _tensorfile

save_dir, point, ready = sys.argv[1], sys.argv[2], sys.argv[3]

def pause():
    open(ready, "w").close()
    time.sleep(600)  # the test kills us here

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
engine, *_ = dscore.initialize(model=model, config=config)

def train(n):
    g = torch.Generator().manual_seed(engine.global_steps)
    for _ in range(n):
        engine.backward(engine(torch.randn(2, 8, generator=g)).pow(2).mean())
        engine.step()

train(2)
engine.save_checkpoint(save_dir, client_state={"at": 2})
train(2)

if point == "mid_write":          # half of the model file's first tensor is on disk
    real = _tensorfile._write_all
    def half_then_pause(f, view):
        real(f, view[: len(view) // 2]); f.flush(); pause()
    _tensorfile._write_all = half_then_pause
elif point == "before_publish":   # every file and _COMPLETE written, the tag directory not yet renamed
    _layout.exchange_or_rename = lambda src, dst: pause()
elif point == "before_latest":    # global_step4 published, latest not yet moved
    real_atomic = _layout.atomic_write_bytes
    def atomic(path, data, **kw):
        if os.path.basename(path) == "latest":
            pause()
        return real_atomic(path, data, **kw)
    _layout.atomic_write_bytes = atomic
engine.save_checkpoint(save_dir, client_state={"at": 4})
print("save was not interrupted", file=sys.stderr)
sys.exit(3)
"""


def _child_env() -> dict[str, str]:
    """A single-process environment with its own rendezvous port (this process may hold one already)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    return env


_DIST_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK"}


def _engine():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    engine, *_ = dscore.initialize(
        model=model, config={"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    )
    return engine


@pytest.mark.parametrize("point", ["mid_write", "before_publish", "before_latest"])
def test_sigkill_during_save_then_resume(tmp_path, point):
    save_dir = tmp_path / "ckpt"
    ready = tmp_path / "ready"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(save_dir), point, str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            if child.poll() is not None:
                pytest.fail(f"child exited with {child.returncode} before the kill point:\n{child.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail("child did not reach the kill point in 240 s")
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()

    names = sorted(os.listdir(save_dir))
    assert (save_dir / "latest").read_text() == "global_step2", names
    assert L.is_complete(str(save_dir / "global_step2"))
    if point == "before_latest":
        assert "global_step4" in names and L.is_complete(str(save_dir / "global_step4"))
    else:
        assert "global_step4" not in names, names  # never visible half-written
        assert any(n.startswith(".global_step4.tmp-") for n in names), names

    # resume from latest in a fresh engine: exactly the child's step-2 state
    engine = _engine()
    path, client = engine.load_checkpoint(str(save_dir))
    assert client == {"at": 2} and engine.global_steps == 2
    saved, _ = read_tensor_file(path)
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k
    manifest = json.loads((save_dir / "global_step2" / L.COMPLETE_FILE).read_text())
    assert manifest["global_steps"] == 2

    # the killed tag can be saved again, and the leftovers go away
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8, generator=g)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(str(save_dir), client_state={"at": 4})
    assert sorted(os.listdir(save_dir)) == ["global_step2", "global_step4", "latest"]
    assert (save_dir / "latest").read_text() == "global_step4"
    again = _engine()
    _, client = again.load_checkpoint(str(save_dir))
    assert client == {"at": 4} and again.global_steps == 4
    for k, v in again.module.state_dict().items():
        assert torch.equal(v, engine.module.state_dict()[k]), k
