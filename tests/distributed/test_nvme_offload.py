"""ZeRO offload to NVMe (``offload_optimizer.device: nvme`` at stage 2, optimizer and ``offload_param`` at
stage 3) through ``dscore.initialize`` on real gloo ranks: bit-for-bit equal to ``device: cpu``,
checkpoints across world sizes, swap-folder lifecycle (close, exit, exception, SIGTERM, kill +
``dscore report``) and the configuration errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow

STEPS = 5


@pytest.fixture(scope="module")
def libaio() -> None:
    """NVMe offload runs on the async_io op, which needs libaio's development files (CI installs
    libaio-dev): without them the tests that swap skip, naming what to install, as tests/ops' ``aio_op``
    does. The configuration errors are checked without it (they are refused before any swap)."""
    from dscore_plugins.ops.aio_builder import AsyncIOBuilder

    ok, reason = AsyncIOBuilder().compatibility()
    if not ok:
        pytest.skip(f"NVMe offload needs the async_io op, not buildable here (libaio-dev): {reason}")
SUB_GROUP = 16_384  # each rank's ~33k-element partition is stepped in 3 sub-groups


def _model():  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _config(stage: int, device: str, folder: str, **offload: Any) -> dict[str, Any]:
    """``device``: cpu or nvme optimizer offload; ``nvmeparam``: stage 3 with optimizer *and* parameters on
    NVMe (at most 20000 partition elements resident: every step evicts and re-reads units)."""
    block: dict[str, Any] = {"device": "nvme" if device == "nvmeparam" else device}
    if device != "cpu":
        block.update(nvme_path=folder, pipeline_read=True, pipeline_write=True, buffer_count=3)
    block.update(offload)
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": block, "sub_group_size": SUB_GROUP,
                            "stage3_param_persistence_threshold": 0}
    if device == "nvmeparam":
        zero["offload_param"] = {"device": "nvme", "nvme_path": folder, "max_in_cpu": 20_000, "buffer_count": 2,
                                 "buffer_size": 40_000}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "aio": {"block_size": 65536, "queue_depth": 4},
    }


def _batch(rank: int, step: int):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 64, generator=g), torch.randn(2, 8, generator=g)


def _train(engine: Any, rank: int, steps: range) -> None:
    for s in steps:
        x, y = _batch(rank, s)
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()


def _snapshot(engine: Any) -> dict[str, Any]:
    """Full weights and full optimizer state as bytes (collective)."""
    weights = {k: v.float().numpy().tobytes() for k, v in engine.module_state_dict().items()}
    zs = engine.zero_stage_impl.state_dict()
    state = {f"{n}.{k}": (v.numpy().tobytes() if hasattr(v, "numpy") else v)
             for n, entry in zs["state"].items() for k, v in entry.items()}
    fp32 = {n: v.numpy().tobytes() for n, v in zs["fp32_params"].items()}
    return {"weights": weights, "state": state, "fp32": fp32}


def _rank_run(root: str, index: str) -> dict[str, Any]:
    """Stage 2 (optimizer offload cpu, nvme) and 3 (cpu, optimizer and parameters on nvme), 5 steps each;
    the nvme runs save a checkpoint."""
    import torch.distributed as dist

    import dscore

    os.environ["DSCORE_SWAP_INDEX"] = index
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for device in ("cpu", "nvmeparam") if stage == 3 else ("cpu", "nvme"):
            folder = os.path.join(root, f"swap{stage}")
            engine, *_ = dscore.initialize(model=_model(), config=_config(stage, device, folder))
            _train(engine, rank, range(STEPS))
            snap = _snapshot(engine)
            if device != "cpu":
                opt = engine.optimizer
                # between steps the state lives in the swap files only
                snap["resident_state"] = len(opt.state)
                snap["resident_master_elems"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
                rank_dirs = sorted(str(p) for p in Path(folder).glob("dscore-swap-*/rank*"))
                snap["rank_dirs"] = rank_dirs
                snap["swap_files"] = len(list(Path(folder).glob(f"dscore-swap-*/rank{rank}/*.swp")))
                engine.save_checkpoint(os.path.join(root, f"ckpt{stage}"), tag=device)
            engine.close()
            if device != "cpu":  # this rank's folder is gone (the run folder goes with the last rank)
                snap["left_after_close"] = sorted(str(p) for p in Path(folder).glob(f"dscore-swap-*/rank{rank}"))
            out[f"{stage}-{device}"] = snap
    return out


def _load_run(root: str, index: str) -> dict[str, Any]:
    """World size 1: load the 2-rank checkpoints with nvme and with cpu offload, train 2 more steps."""
    import dscore

    os.environ["DSCORE_SWAP_INDEX"] = index
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for device in ("cpu", "nvme", "nvmeparam") if stage == 3 else ("cpu", "nvme"):
            engine, *_ = dscore.initialize(model=_model(), config=_config(stage, device, os.path.join(root, "load")))
            engine.load_checkpoint(os.path.join(root, f"ckpt{stage}"), tag="nvme" if stage == 2 else "nvmeparam")
            loaded = _snapshot(engine)
            # weights changed outside the optimizer reach the masters (and partitions) in swap too
            with dscore.zero.GatheredParameters(engine.module[0].weight, modifier_rank=0):
                engine.module[0].weight.data.mul_(0.5)
            _train(engine, 0, range(STEPS, STEPS + 2))
            out[f"{stage}-{device}"] = {"loaded": loaded, "after": _snapshot(engine)}
            engine.close()
    out["left"] = sorted(str(p) for p in Path(root, "load").rglob("*"))
    return out


def test_nvme_offload_equals_cpu_offload_and_checkpoints_move_across_world_sizes(tmp_path: Path, libaio: None) -> None:
    index = str(tmp_path / "swap_index")
    ranks = run_distributed(_rank_run, 2, str(tmp_path), index, timeout=600)
    for rank, res in enumerate(ranks):
        for stage, variant in ((2, "nvme"), (3, "nvmeparam")):
            cpu, nvme = res[f"{stage}-cpu"], res[f"{stage}-{variant}"]
            for part in ("weights", "state", "fp32"):
                assert cpu[part].keys() == nvme[part].keys(), (stage, part)
                diff = [k for k in cpu[part] if cpu[part][k] != nvme[part][k]]
                assert not diff, f"stage {stage} rank {rank}: {part} differ for {diff[:4]}"
            assert any(k.endswith(".exp_avg_sq") for k in nvme["state"])
            assert nvme["resident_state"] == 0 and nvme["resident_master_elems"] == 0
            assert nvme["swap_files"] >= 3 * 3  # 3 sub-groups x (master, exp_avg, exp_avg_sq)
            # one run folder per swapper (its run id agreed from rank 0), one subfolder per rank in each
            dirs = [Path(d) for d in nvme["rank_dirs"]]
            runs = 2 if variant == "nvmeparam" else 1
            assert sorted(d.name for d in dirs) == sorted(["rank0", "rank1"] * runs) and len({d.parent for d in dirs}) == runs
            assert nvme["left_after_close"] == []
    assert ranks[0]["2-cpu"]["weights"] == ranks[1]["2-cpu"]["weights"]
    assert not list(tmp_path.glob("swap*/*")), "swap folders left after engine.close()"

    res = run_distributed(_load_run, 1, str(tmp_path), index, timeout=600)[0]
    for stage, variant in ((2, "nvme"), (3, "nvme"), (3, "nvmeparam")):
        saved = ranks[0][f"{stage}-{'nvme' if stage == 2 else 'nvmeparam'}"]
        cpu, nvme = res[f"{stage}-cpu"], res[f"{stage}-{variant}"]
        assert nvme["loaded"]["fp32"] == saved["fp32"] and nvme["loaded"]["state"] == saved["state"]
        assert nvme["loaded"]["weights"] == saved["weights"]
        for part in ("weights", "state", "fp32"):
            assert cpu["after"][part] == nvme["after"][part], (stage, variant, part)
        assert cpu["after"]["fp32"] != cpu["loaded"]["fp32"]  # it did train on
    assert res["left"] == []


def _errors(root: str) -> list[str]:
    import dscore
    from dscore.errors import ConfigError

    os.environ["DSCORE_SWAP_INDEX"] = os.path.join(root, "swap_index")
    seen = []
    blocker = Path(root, "a_file")
    blocker.write_text("x")
    cases = [
        (_config(2, "nvme", str(blocker / "swap")), "zero_optimization.offload_optimizer.nvme_path"),
        ({**_config(2, "cpu", root), "zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": root}}},
         "zero_optimization.offload_param.device"),
        ({**_config(2, "cpu", root), "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": root}}},
         "zero_optimization.offload_optimizer.device"),
        ({**_config(2, "cpu", root), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         "nvme_path"),
        ({**_config(3, "cpu", root), "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                           "offload_param": {"device": "nvme", "nvme_path": root,
                                                                             "buffer_size": 1000}}},
         "zero_optimization.offload_param.buffer_size"),
    ]
    for cfg, key in cases:
        try:
            dscore.initialize(model=_model(), config=cfg)
        except ConfigError as exc:
            assert key in str(exc), (key, str(exc))
            seen.append(str(exc))
        else:
            raise AssertionError(f"no error for {key}")
    return seen


def test_configuration_errors_name_the_key(tmp_path: Path) -> None:
    msgs = run_distributed(_errors, 1, str(tmp_path), timeout=300)[0]
    assert "cannot hold swap files" in msgs[0] and "smaller than the largest parameter partition" in msgs[4]
    assert not list(tmp_path.glob("**/dscore-swap-*"))


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    sys.path.insert(0, sys.argv[3])
    from test_nvme_offload import _config, _model, _train
    import dscore

    engine, *_ = dscore.initialize(model=_model(), config=_config(2, "nvme", sys.argv[2]))
    _train(engine, 0, range(1))
    print("trained", flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "term":  # what the launcher sends the other ranks when one fails
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    if sys.argv[1] == "raise":
        raise RuntimeError("the training script failed")
    # "exit": leave without engine.close()
    """
)


def _start_child(mode: str, folder: Path, index: Path) -> subprocess.Popen[str]:
    from dscore.testing import find_free_port

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(find_free_port()), OMP_NUM_THREADS="1", DSCORE_SWAP_INDEX=str(index))
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(folder), str(Path(__file__).parent)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_swap_folders_go_at_exit_on_error_and_sigterm_and_killed_runs_are_reported(tmp_path: Path, libaio: None) -> None:
    from dscore.env_report import format_report

    index = tmp_path / "swap_index"
    modes = {"exit": 0, "raise": 1, "term": -15, "kill": -9}
    procs = {mode: _start_child(mode, tmp_path / mode, index) for mode in modes}  # concurrently: saves time
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == modes[mode] and "trained" in out, (mode, err[-3000:])
    for mode in ("exit", "raise", "term"):  # exit, exception, SIGTERM: gone without engine.close()
        assert not list((tmp_path / mode).glob("dscore-swap-*")), (mode, list((tmp_path / mode).rglob("*")))
    stale = list((tmp_path / "kill").glob("dscore-swap-*/rank0"))
    assert len(stale) == 1
    env = dict(os.environ, DSCORE_SWAP_INDEX=str(index))
    report = json.loads(subprocess.run([sys.executable, "-m", "dscore", "report", "--json"], env=env,
                                       capture_output=True, text=True, timeout=300, check=True).stdout)
    swap = report["swap"]["value"]
    assert swap["stale"] == [str(stale[0].resolve())]
    assert {str((tmp_path / m).resolve()) for m in modes} == set(swap["roots"])
    text = format_report(report)
    assert "1 stale" in text and f"stale: {stale[0].resolve()}" in text
