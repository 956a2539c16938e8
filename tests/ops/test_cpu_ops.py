"""CPU ops built for real with ninja (session cache) and checked against torch references."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dscore.errors import ConfigError, OpBuildError
from dscore.ops import get_op_builder

pytestmark = pytest.mark.slow

SIZES = (1, 7, 8, 33, 1000, 40_001)  # tails, exactly one vector, three OpenMP chunks of 16384


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES] + [torch.randn(17, 9, generator=g)]


def _run_pair(make_ours, make_ref, steps: int = 60, seed: int = 0, threads: int = 1):  # type: ignore[no-untyped-def]
    base = _params(seed)
    ours = [p.clone() for p in base]
    ref = [p.clone() for p in base]
    opt, ref_opt = make_ours(ours), make_ref(ref)
    gen = torch.Generator().manual_seed(seed + 1)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            for a, b in zip(ours, ref):
                grad = torch.randn(a.shape, generator=gen)
                a.grad, b.grad = grad.clone(), grad.clone()
            opt.step()
            ref_opt.step()
    finally:
        torch.set_num_threads(old)
    return opt, ref_opt, ours, ref


def _close(ours: list[torch.Tensor], ref: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- Adam / AdamW
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_cpu_adam_matches_torch(cpu_ops: dict[str, ModuleType], adamw_mode: bool, weight_decay: float) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay)
    # two OpenMP threads for one case (chunks split across threads); one elsewhere (shared CI cores)
    threads = 2 if adamw_mode and weight_decay else 1
    opt, ref_opt, ours, ref = _run_pair(lambda p: DscoreCPUAdam(p, adamw_mode=adamw_mode, **kw),
                                        lambda p: ref_cls(p, **kw), threads=threads)
    _close(ours, ref)
    for a, b in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], ref_opt.state[b][key], rtol=1e-5, atol=1e-7)
        assert float(opt.state[a]["step"]) == float(ref_opt.state[b]["step"]) == 60


def test_cpu_adam_without_bias_correction(cpu_ops: dict[str, ModuleType]) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    class RefAdamNoBC(torch.optim.Optimizer):
        def __init__(self, params, lr, betas, eps):  # type: ignore[no-untyped-def]
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

        @torch.no_grad()
        def step(self):  # type: ignore[no-untyped-def]
            for group in self.param_groups:
                b1, b2 = group["betas"]
                for p in group["params"]:
                    st = self.state[p]
                    if not st:
                        st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                    st["m"].lerp_(p.grad, 1 - b1)
                    st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    p.addcdiv_(st["m"], st["v"].sqrt().add_(group["eps"]), value=-group["lr"])

    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    _, _, ours, ref = _run_pair(lambda p: DscoreCPUAdam(p, bias_correction=False, **kw), lambda p: RefAdamNoBC(p, **kw))
    _close(ours, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_adam_step_with_copy_is_exact(cpu_ops: dict[str, ModuleType], dtype: torch.dtype) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    params = [p * 100 for p in _params(3)]  # values over fp16's subnormal..large range
    params[1][0] = 70000.0  # overflows fp16 -> inf, like torch
    opt = DscoreCPUAdam(params, lr=1e-2, weight_decay=0.01)
    copies = [torch.empty(p.shape, dtype=dtype) for p in params]
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step_with_copy(copies if step else [*copies[:-1], None])
        for p, c in zip(params, copies):
            assert torch.equal(c, p.to(dtype)) or (step == 0 and c is copies[-1])
    with pytest.raises(OpBuildError, match="copy targets"):
        opt.step_with_copy([torch.empty(3, dtype=dtype)] * len(params))
    with pytest.raises(OpBuildError, match="copy targets for"):
        opt.step_with_copy(copies[:-1])


def test_cpu_adam_state_dict_interchanges_with_torch(cpu_ops: dict[str, ModuleType]) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    kw = dict(lr=2e-3, weight_decay=0.1)
    ours_opt, ref_opt, ours, ref = _run_pair(lambda p: DscoreCPUAdam(p, **kw), lambda p: torch.optim.AdamW(p, **kw),
                                             steps=5)
    # continue: torch AdamW resumed from our state dict vs ours resumed from torch's state dict
    resumed_ref_params = [p.detach().clone() for p in ours]
    resumed_ref = torch.optim.AdamW(resumed_ref_params, **kw)
    resumed_ref.load_state_dict(ours_opt.state_dict())
    resumed_ours_params = [p.detach().clone() for p in ref]
    resumed_ours = DscoreCPUAdam(resumed_ours_params, **kw)
    resumed_ours.load_state_dict(ref_opt.state_dict())
    assert resumed_ours.param_groups[0]["adamw_mode"] is True  # default filled in for torch's groups
    gen = torch.Generator().manual_seed(9)
    for _ in range(5):
        for a, b in zip(resumed_ref_params, resumed_ours_params):
            grad = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = grad.clone(), grad.clone()
        resumed_ref.step()
        resumed_ours.step()
    _close(resumed_ours_params, resumed_ref_params)


def test_cpu_adam_rejects_bad_inputs(cpu_ops: dict[str, ModuleType]) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    with pytest.raises(ConfigError, match="amsgrad"):
        DscoreCPUAdam([torch.zeros(4)], amsgrad=True)
    with pytest.raises(OpBuildError, match="fp32 CPU"):
        DscoreCPUAdam([torch.zeros(4, dtype=torch.float16)])
    p = torch.zeros(4, 4)
    opt = DscoreCPUAdam([p])
    p.grad = torch.zeros(4, 4).t()  # not contiguous
    with pytest.raises(OpBuildError, match="gradients"):
        opt.step()


# ---------------------------------------------------------------- Adagrad
@pytest.mark.parametrize(("weight_decay", "lr_decay", "init"), [(0.0, 0.0, 0.0), (0.02, 0.01, 0.1)])
def test_cpu_adagrad_matches_torch(cpu_ops: dict[str, ModuleType], weight_decay: float, lr_decay: float, init: float) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdagrad

    kw = dict(lr=5e-2, lr_decay=lr_decay, weight_decay=weight_decay, initial_accumulator_value=init, eps=1e-10)
    opt, ref_opt, ours, ref = _run_pair(lambda p: DscoreCPUAdagrad(p, **kw), lambda p: torch.optim.Adagrad(p, **kw))
    _close(ours, ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(opt.state[a]["sum"], ref_opt.state[b]["sum"], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- Lion
class RefLion(torch.optim.Optimizer):
    """Lion as in Chen et al. 2023 (Algorithm 2), plain torch ops."""

    def __init__(self, params, lr, betas, weight_decay):  # type: ignore[no-untyped-def]
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(c), alpha=-lr)
                m.mul_(b2).add_(p.grad * (1 - b2))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_lion_matches_reference(cpu_ops: dict[str, ModuleType], weight_decay: float) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPULion

    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    opt, ref_opt, ours, ref = _run_pair(lambda p: DscoreCPULion(p, **kw), lambda p: RefLion(p, **kw), steps=80)
    _close(ours, ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(opt.state[a]["exp_avg"], ref_opt.state[b]["exp_avg"], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- cache behaviour
def test_cached_load_does_not_rebuild(cpu_ops: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension as cpp_extension

    builder = get_op_builder("cpu_adam")
    library = builder.cached_build()
    assert library is not None and library.is_file()
    mtime = library.stat().st_mtime_ns

    def fail(*a: object, **k: object) -> None:
        raise AssertionError("a cached op must not be rebuilt")

    monkeypatch.setattr(cpp_extension, "load", fail)
    type(builder)._loaded.clear()
    assert builder.load() is cpu_ops["cpu_adam"]
    assert library.stat().st_mtime_ns == mtime


def test_cached_load_in_fresh_process_runs_no_ninja(cpu_ops: dict[str, ModuleType], ops_cache: Path, tmp_path: Path) -> None:
    """Another process (e.g. a venv whose ninja differs only on PATH order) loads the build as is."""
    code = textwrap.dedent(
        """
        import time, torch
        import torch.utils.cpp_extension as ce
        def fail(*a, **k):
            raise SystemExit("rebuilt")
        ce.load = fail
        from dscore.ops import get_op_builder
        t = time.perf_counter()
        m = get_op_builder("cpu_adam").load()
        print(m.simd, f"{time.perf_counter() - t:.3f}")
        """
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ops_cache))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    simd, seconds = proc.stdout.split()
    assert simd == cpu_ops["cpu_adam"].simd
    print(f"cached cpu_adam load in a fresh process: {seconds} s")


def test_edited_source_is_rebuilt_not_reused(cpu_ops: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    builder = get_op_builder("cpu_lion")
    plan = builder.plan()
    assert builder.cached_build(plan) is not None
    real = builder.source_digest()
    monkeypatch.setattr(type(builder), "source_digest", lambda self: "0" * 64 if real else real)
    assert builder.cached_build(plan) is None


# ---------------------------------------------------------------- scalar fallback + stale lock of a killed build
_KILLED_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dscore.ops.builder import build_lock
    lock, build_dir = Path(sys.argv[1]), Path(sys.argv[2])
    with build_lock(lock):
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "lock").write_text("")  # torch's FileBaton, as a build killed mid-way leaves it
        print("building", flush=True)
        time.sleep(120)
    """
)


def test_scalar_fallback_build_after_killed_build(
    cpu_ops: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build killed with SIGKILL leaves its lock and torch's baton; the next build removes both with a
    warning instead of waiting forever. The result is the portable scalar kernel, checked against torch."""
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    monkeypatch.setenv("DSCORE_CPU_SIMD", "scalar")
    builder = get_op_builder("cpu_adam")
    plan = builder.plan()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, str(plan.lock_path), str(plan.directory)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "building"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (plan.directory / "lock").exists()
    with caplog.at_level(logging.WARNING, logger="dscore.ops"):
        module = builder.load()
    assert module.simd == "scalar" and module is not cpu_ops["cpu_adam"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "stale build lock" in messages
    import torch.utils.cpp_extension as cpp_extension

    if hasattr(cpp_extension, "FileBaton"):  # torch versions whose lock file blocks by existence
        assert "stale torch build lock" in messages
    assert not (plan.directory / "lock").exists()

    # numerics of the scalar path (including its software fp16/bf16 conversion)
    monkeypatch.setattr("dscore_plugins.ops.cpu_optim._load", lambda name: module)
    kw = dict(lr=1e-3, weight_decay=0.01)
    _, _, ours, ref = _run_pair(lambda p: DscoreCPUAdam(p, **kw), lambda p: torch.optim.AdamW(p, **kw), steps=20)
    _close(ours, ref)
    values = torch.cat([torch.randn(5000) * s for s in (1e-8, 1e-5, 1.0, 1e3, 7e4)])
    values[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    p = values.clone()
    opt = DscoreCPUAdam([p], lr=0.0)
    p.grad = torch.zeros_like(p)
    for dtype in (torch.float16, torch.bfloat16):
        copy = torch.empty(p.shape, dtype=dtype)
        opt.step_with_copy([copy])
        expect = p.to(dtype)
        same = (copy == expect) | (copy.isnan() & expect.isnan())
        assert bool(same.all()), f"{dtype}: {int((~same).sum())} mismatches"
    assert math.isnan(float(p[0]))
