"""dscore runs without numpy (issue 38 item 0): dscore does not depend on numpy, so nothing on the path of a
plain multi-rank job (initialize, steps, save_checkpoint, load_checkpoint) may need it.

torch's own object collectives (``dist.all_gather_object`` / ``broadcast_object_list``) unpickle with
``tensor.numpy()`` and raise "Numpy is not available" without it; dscore's (``dscore.comm.objects``) do not.
The ranks here are real processes of ``dscore run`` in which numpy is made unimportable before torch loads
(tests/integration/no_numpy_job.py); tools/clean_install_check.sh runs the same job in a venv with no numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dscore.testing import find_free_port

HERE = Path(__file__).resolve().parent
JOB = HERE / "no_numpy_job.py"
STEPS = 3


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "DS_ENV_FILE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _reference() -> tuple[list[list[float]], list[float]]:
    """Plain PyTorch data parallelism of the job's model and data: per-rank losses of each step and the
    parameter checksum after the steps (gradients averaged over the two ranks, then Adam)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gens = [torch.Generator(device="cpu").manual_seed(100 + r) for r in range(2)]
    losses: list[list[float]] = [[], []]
    for _ in range(STEPS):
        grads = []
        for r in range(2):
            model.zero_grad()
            loss = model(torch.randn(4, 6, generator=gens[r])).pow(2).mean()
            loss.backward()
            losses[r].append(float(loss.detach()))
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    state = model.state_dict()
    flat = torch.cat([state[k].detach().to(torch.float64).flatten() for k in sorted(state)])
    return losses, [float(flat.sum()), float(flat.pow(2).sum())]


@pytest.mark.slow
def test_two_rank_job_runs_with_numpy_unimportable(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dscore", "run", "--num_gpus", "2", "--master_port", str(find_free_port()),
           str(JOB), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"the job exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ref_losses, ref_sum = _reference()
    for r, report in enumerate(ranks):
        assert report["numpy_imported"] is False
        assert report["world"] == 2 and report["rank"] == r
        for stage in ("0", "3"):
            s = report["stages"][stage]
            assert s["losses"] == pytest.approx(ref_losses[r], rel=1e-5), (stage, r)
            assert s["saved"] == pytest.approx(ref_sum, rel=1e-5), (stage, r)
            assert s["loaded"] == s["saved"], (stage, r)  # the checkpoint restored every parameter exactly
            assert s["client"] == {"stage": int(stage)}
            assert s["global_steps"] == STEPS + 1
    for stage in ("0", "3"):  # after loading, both ranks trained on from the same state
        assert ranks[0]["stages"][stage]["loaded"] == ranks[1]["stages"][stage]["loaded"]


_NO_NUMPY_HELPERS = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # unimportable before torch loads, as where numpy is not installed
    import json
    import torch
    from dscore.persistence._rng import derived_seed
    from dscore_plugins.checkpoint_ds._convert import _StreamFile

    state = torch.arange(0, 250, 7, dtype=torch.uint8)
    seed = derived_seed("tag", 1, state)
    values = {"b": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16), "f": torch.arange(4, dtype=torch.float32)}
    out = _StreamFile(sys.argv[1], {k: (v.dtype, tuple(v.shape)) for k, v in values.items()}, {"m": "1"})
    for k, v in values.items():
        out.write(k, 0, v)
    out.close()
    print(json.dumps({"seed": seed, "numpy": sys.modules.get("numpy") is not None}))
    """
)


def test_checkpoint_byte_helpers_need_no_numpy(tmp_path: Path) -> None:
    """The rank-seed derivation of an elastic load and the DeepSpeed-layout file writer read tensor bytes
    without ``tensor.numpy()``, and give the bytes numpy would."""
    import torch
    from safetensors.torch import load_file

    path = tmp_path / "t.safetensors"
    proc = subprocess.run([sys.executable, "-c", _NO_NUMPY_HELPERS, str(path)], env=_env(), capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"the helpers failed without numpy:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["numpy"] is False
    import hashlib

    state = torch.arange(0, 250, 7, dtype=torch.uint8)
    digest = hashlib.sha256(b"dscore-rng:tag:1:" + state.numpy().tobytes()).digest()
    assert result["seed"] == int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    loaded = load_file(str(path))
    assert torch.equal(loaded["b"], torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16))
    assert torch.equal(loaded["f"], torch.arange(4, dtype=torch.float32))


def test_einsum_flops_without_numpy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore_plugins.profiling.formulas import FlopsProfilerError, einsum_flops

    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(FlopsProfilerError, match=r"dscore\[profiling\]") as info:
        einsum_flops("ij,jk->ik", [(2, 3), (3, 4)])
    assert "ij,jk->ik" in str(info.value)
