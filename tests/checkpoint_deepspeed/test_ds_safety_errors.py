"""Reading DeepSpeed checkpoints safely: no code from a pickle, clear errors, nothing applied half-way."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types

import ds_fixture_helpers as H
import pytest

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.testing import run_distributed

needs_fixtures = pytest.mark.skipif(not H.FIXTURES.is_dir(), reason=f"DeepSpeed fixtures not found at {H.FIXTURES}")


class _Payload:
    """Unpickling this runs ``os.mkdir(marker)``: the classic ``__reduce__`` code-execution payload."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _write_payload(path: str, marker: str) -> None:
    import torch

    torch.save({"optimizer_state_dict": {"loss_scaler": _Payload(marker)}, "ds_version": "0.19.8"}, path)


def test_reduce_payload_is_refused_and_never_runs(tmp_path) -> None:
    from dscore.checkpoint.deepspeed import safe_load

    evil = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    marker = str(tmp_path / "PWNED")
    _write_payload(evil, marker)
    with pytest.raises(CheckpointError) as info:
        safe_load(evil)
    text = str(info.value)
    assert "mkdir" in text and evil in text and "allow-list" in text
    assert not os.path.exists(marker)
    # the payload is real: an unrestricted torch.load does run it (harmless here: a directory in tmp_path)
    import torch

    torch.load(evil, weights_only=False)
    assert os.path.isdir(marker)


def _fake_module(monkeypatch, name: str) -> types.ModuleType:
    """Register ``name`` and its parents as empty modules (DeepSpeed is not installed here)."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return sys.modules[name]


def test_unlisted_deepspeed_type_is_refused(tmp_path, monkeypatch) -> None:
    """Even a DeepSpeed class is refused when it is not on the allow-list (the type is named)."""
    import torch

    from dscore.checkpoint.deepspeed import safe_load

    mod = _fake_module(monkeypatch, "deepspeed.runtime.zero.stage3")

    class DeepSpeedZeroOptimizer_Stage3:  # noqa: N801 - DeepSpeed's name
        pass

    DeepSpeedZeroOptimizer_Stage3.__module__ = mod.__name__
    DeepSpeedZeroOptimizer_Stage3.__qualname__ = "DeepSpeedZeroOptimizer_Stage3"
    mod.DeepSpeedZeroOptimizer_Stage3 = DeepSpeedZeroOptimizer_Stage3
    path = str(tmp_path / "x.pt")
    torch.save({"optimizer": DeepSpeedZeroOptimizer_Stage3()}, path)
    with pytest.raises(CheckpointError, match=r"deepspeed\.runtime\.zero\.stage3\.DeepSpeedZeroOptimizer_Stage3"):
        safe_load(path)


def test_dynamic_loss_scaler_state_is_read(tmp_path, monkeypatch) -> None:
    """fp16 ZeRO files hold a DynamicLossScaler object: read through the stand-in into dscore's form."""
    import torch

    from dscore.checkpoint.deepspeed import safe_load
    from dscore_plugins.checkpoint_ds._pieces import scaler_state

    mod = _fake_module(monkeypatch, "deepspeed.runtime.fp16.loss_scaler")

    class DynamicLossScaler:
        pass

    DynamicLossScaler.__module__ = mod.__name__
    DynamicLossScaler.__qualname__ = "DynamicLossScaler"
    mod.DynamicLossScaler = DynamicLossScaler
    s = DynamicLossScaler()
    s.__dict__.update(
        cur_scale=1024.0,
        cur_iter=37,
        last_overflow_iter=30,
        scale_factor=2.0,
        scale_window=1000,
        min_scale=1.0,
        delayed_shift=2,
        cur_hysteresis=1,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=True,
        dynamic=True,
        dtype=torch.float16,
    )
    path = str(tmp_path / "scaler.pt")
    torch.save({"optimizer_state_dict": {"loss_scaler": s, "dynamic_loss_scale": True}}, path)
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)  # dscore must not need the class to exist
    osd = safe_load(path)["optimizer_state_dict"]
    assert scaler_state(osd) == {
        "dynamic": True,
        "cur_scale": 1024.0,
        "cur_iter": 37,
        "last_overflow_iter": 30,
        "cur_hysteresis": 1,
    }
    # stage-0 FP16_Optimizer keeps plain keys instead of an object
    assert scaler_state({"dynamic_loss_scale": True, "cur_scale": 256.0, "cur_iter": 5, "last_overflow_iter": 2}) == {
        "dynamic": True,
        "cur_scale": 256.0,
        "cur_iter": 5,
        "last_overflow_iter": 2,
    }


# ------------------------------------------------------------------------------------------ layouts


def _copy(tmp_path, name: str = "z2_fp32_ws2"):
    dst = tmp_path / name
    shutil.copytree(H.FIXTURES / name, dst)
    for root, dirs, files in os.walk(dst):
        for n in dirs + files:
            os.chmod(os.path.join(root, n), 0o755 if n in dirs else 0o644)
    os.chmod(dst, 0o755)
    return dst


@needs_fixtures
def test_missing_shard_names_the_file(tmp_path) -> None:
    from dscore.checkpoint.deepspeed import DeepSpeedCheckpoint

    d = _copy(tmp_path)
    os.unlink(d / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(
        CheckpointNotFoundError, match=r"saved by 2 rank\(s\).*zero_pp_rank_1_mp_rank_00_optim_states\.pt"
    ):
        DeepSpeedCheckpoint(str(d))
    d3 = _copy(tmp_path, "z3_fp32_ws2")
    os.unlink(d3 / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointNotFoundError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt"):
        DeepSpeedCheckpoint(str(d3))


@needs_fixtures
@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ("mp_rank_01_model_states.pt", r"tensor/model-parallel.*mp_rank_01_model_states\.pt"),
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt", r"tensor/model-parallel.*mp_rank_01"),
        ("layer_01-model_00-model_states.pt", r"pipeline-parallel.*layer_01-model_00-model_states\.pt"),
        (
            "layer_0_expert_1_mp_rank_00_model_states.pt",
            r"expert files are present \(layer_0_expert_1_mp_rank_00_model_states\.pt.*num_experts. is None",
        ),
    ],
)
def test_unknown_layouts_are_refused(tmp_path, extra: str, pattern: str) -> None:
    from dscore.checkpoint.deepspeed import DeepSpeedCheckpoint

    d = _copy(tmp_path)
    shutil.copy(d / "global_step3" / "mp_rank_00_model_states.pt", d / "global_step3" / extra)
    with pytest.raises(CheckpointError, match=pattern):
        DeepSpeedCheckpoint(str(d))


@needs_fixtures
def test_world_size_that_cannot_be_worked_out(tmp_path) -> None:
    import torch

    from dscore.checkpoint.deepspeed import DeepSpeedCheckpoint, safe_load

    d = _copy(tmp_path)
    model = d / "global_step3" / "mp_rank_00_model_states.pt"
    state = safe_load(str(model), mmap=False)
    del state["dp_world_size"]
    torch.save(state, model)
    os.unlink(d / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(
        CheckpointError, match=r"cannot work out the world size.*zero_pp_rank_1_mp_rank_00_optim_states"
    ):
        DeepSpeedCheckpoint(str(d))


@needs_fixtures
def test_directory_rules(tmp_path) -> None:
    from dscore.checkpoint.deepspeed import DeepSpeedCheckpoint, is_deepspeed_checkpoint

    d = _copy(tmp_path)
    assert is_deepspeed_checkpoint(str(d)) and not is_deepspeed_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match=r"tag directory.*tag='global_step3'"):
        DeepSpeedCheckpoint(str(d / "global_step3"))
    with pytest.raises(CheckpointNotFoundError, match=r"tag 'global_step9' does not exist.*global_step3"):
        DeepSpeedCheckpoint(str(d), tag="global_step9")
    with pytest.raises(CheckpointNotFoundError, match=r"latest_universal"):
        DeepSpeedCheckpoint(str(d), universal=True)
    assert DeepSpeedCheckpoint(str(d), tag="global_step3").stage == 2
    os.unlink(d / "latest")
    with pytest.raises(CheckpointNotFoundError, match=r"no 'latest' file.*global_step3"):
        DeepSpeedCheckpoint(str(d))
    os.mkdir(d / "global_step3" / "zero")
    with pytest.raises(CheckpointError, match=r"universal checkpoint"):
        DeepSpeedCheckpoint(str(d), tag="global_step3")


# ------------------------------------------------------------------------------------------ export


@needs_fixtures
def test_export_fp32_equals_deepspeed_masters(tmp_path) -> None:
    """`dscore checkpoint export DS_DIR --fp32 OUT` reproduces DeepSpeed's consolidated fp32 masters."""
    from safetensors.torch import load_file

    from dscore.checkpoint.deepspeed import export_fp32
    from dscore.cli.main import main

    for i, name in enumerate(H.fixture_names() + [os.path.basename(p) for p in H.extra_paths()]):
        src = H.FIXTURES / name if (H.FIXTURES / name).is_dir() else H.DATA / name
        exp = H.expected(str(src))
        out = str(tmp_path / f"{name}.safetensors")
        if i == 0:
            assert main(["checkpoint", "export", str(src), "--fp32", out]) == 0
        else:
            export_fp32(str(src), out)
        got = load_file(out)
        want = exp["at_save"].get("fp32_master")
        if want is None:  # stage 0: the module holds the masters (fp32 runs only)
            assert exp["dtype"] == "fp32" or exp["zero_stage"] == 0
            want = exp["at_save"]["params"] if exp["dtype"] == "fp32" else None
        if want is None:
            continue
        assert set(want) <= set(got), (name, sorted(got))
        for k, v in want.items():
            if got[k].is_floating_point():  # integer buffers (num_batches_tracked) keep their dtype
                assert str(got[k].dtype) == "torch.float32", (name, k, got[k].dtype)
            assert got[k].reshape(-1).tolist() == v, (name, k)
        if exp.get("model") == "tied":
            assert got["head.weight"].equal(got["emb.weight"])


@needs_fixtures
def test_cli_import_then_export_roundtrip(tmp_path) -> None:
    from safetensors.torch import load_file

    from dscore.cli.main import main

    src = H.FIXTURES / "z3_bf16_ws1"
    exp = H.expected(str(src))
    assert main(["checkpoint", "import", str(src), str(tmp_path / "imp")]) == 0
    assert (tmp_path / "imp" / "latest").read_text() == "global_step3"
    manifest = json.loads((tmp_path / "imp" / "global_step3" / "_COMPLETE").read_text())
    assert manifest["world_size"] == 1 and manifest["zero_stage"] == 3
    out = str(tmp_path / "w.safetensors")
    assert main(["checkpoint", "export", str(tmp_path / "imp"), "--fp32", out]) == 0
    got = load_file(out)
    for k, v in exp["at_save"]["fp32_master"].items():
        assert got[k].reshape(-1).tolist() == v
    assert main(["checkpoint", "import", str(tmp_path / "imp"), str(tmp_path / "again")]) == 2  # not DeepSpeed
    assert main(["checkpoint", "export", str(src), "--fp32", out, "--dtype", "bf16"]) == 2


# ------------------------------------------------------------------------------------------ engine


@needs_fixtures
def test_engine_load_options_and_refusals(tmp_path) -> None:
    """On 2 ranks: refusals leave the engine untouched (missing shard, poisoned shard, strict mismatch); the
    load options keep DeepSpeed's meaning; load_universal without latest_universal is an error."""
    d = _copy(tmp_path)
    broken = _copy(tmp_path, "z3_fp32_ws2")
    os.unlink(broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    no_latest = _copy(tmp_path, "z1_fp32_ws2")
    os.unlink(no_latest / "latest")
    # a poisoned shard inside an otherwise real checkpoint
    poisoned = _copy(tmp_path, "z2_bf16_ws2")
    evil = str(poisoned / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    marker = str(tmp_path / "PWNED")
    _write_payload(evil, marker)
    out = run_distributed(H.options_worker, 2, str(d), str(broken), str(no_latest), str(poisoned), timeout=300)
    r = out[0]
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["poisoned"]["error"], r["poisoned"]
    assert "mkdir" in r["poisoned"]["error"] and r["poisoned"]["unchanged"]
    assert not os.path.exists(marker)
    assert (
        r["missing_shard"]["unchanged"] and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["missing_shard"]["error"]
    )
    assert "latest_universal" in r["universal_error"]
    assert r["no_latest"] == [None, None]
    assert r["strict_error"] and r["strict_unchanged"]
    exp = H.expected(str(H.FIXTURES / "z2_fp32_ws2"))
    mo = r["module_only"]
    assert mo["weights_err"] < 1e-7 and mo["global_steps"] == 0 and mo["optimizer_state_entries"] == 0
    assert mo["client"] == exp["client_state"]
    no_opt = r["no_optimizer_states"]
    assert no_opt["global_steps"] == 3 and no_opt["optimizer_state_entries"] == 0 and no_opt["weights_err"] < 1e-7
    no_sched = r["no_scheduler"]
    assert no_sched["last_batch_iteration"] == -1 and no_sched["global_steps"] == 3
    assert r["full"]["last_batch_iteration"] == 2 and r["full"]["optimizer_state_entries"] > 0
