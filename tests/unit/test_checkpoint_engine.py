"""save_checkpoint / load_checkpoint / save_16bit_model / export on real single-process engines."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch

import dscore
from dscore.checkpoint import convert_checkpoint, get_fp32_state_dict_from_checkpoint
from dscore.cli.main import main as cli_main
from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import savedir as L
from dscore.persistence.tensorfile import read_tensor_file


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _engine(seed: int = 0, *, stage: int = 0, extra: dict | None = None):
    config = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": 50, "warmup_num_steps": 4, "warmup_max_lr": 1e-2},
        },
        "zero_optimization": {"stage": stage},
    }
    config.update(extra or {})
    engine, *_ = dscore.initialize(model=_model(seed), config=config)
    return engine


def _train(engine, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(2, 6, generator=g).to(dtype)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()


def _same_state(a, b) -> None:
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.zero_stage_impl.state_dict(), b.zero_stage_impl.state_dict()
    assert oa["param_names"] == ob["param_names"]
    for name, st in oa["state"].items():
        for key, val in st.items():
            other = ob["state"][name][key]
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(other)), (name, key)
    assert [g["lr"] for g in a.optimizer.param_groups] == [g["lr"] for g in b.optimizer.param_groups]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One engine trained 3 steps and saved twice (global_step3, then 'extra' without moving latest).

    ``initialize`` exports RANK/WORLD_SIZE/...; a module fixture runs outside the per-test environment
    restore, so it restores the environment itself (else WORLD_SIZE leaks into later test modules)."""
    saved_env = dict(os.environ)
    save_dir = tmp_path_factory.mktemp("ckpt")
    engine = _engine()
    _train(engine, 3)
    client = {"epoch": 3, "optimizer": "mine", "global_steps": -1, "module": [1, 2], "t": torch.arange(3)}
    assert engine.save_checkpoint(str(save_dir), client_state=client) is True
    engine.save_checkpoint(str(save_dir), tag="extra", client_state={}, save_latest=False)
    yield engine, save_dir, client
    os.environ.clear()
    os.environ.update(saved_env)


def test_layout_default_tag_and_latest(trained):
    engine, save_dir, _ = trained
    assert sorted(os.listdir(save_dir)) == ["extra", "global_step3", "latest"]
    assert (save_dir / "latest").read_text() == "global_step3"
    files = sorted(os.listdir(save_dir / "global_step3"))
    assert files == sorted([L.COMPLETE_FILE, L.MODEL_FILE, L.OPTIM_FILE, L.ENGINE_FILE, L.rank_file(0)])
    manifest = json.loads((save_dir / "global_step3" / L.COMPLETE_FILE).read_text())
    assert manifest["world_size"] == 1 and manifest["tag"] == "global_step3" and manifest["global_steps"] == 3
    for name, entry in manifest["files"].items():
        assert os.path.getsize(save_dir / "global_step3" / name) == entry["bytes"]
    # the model file is a plain state dict any safetensors reader can use
    model, _ = read_tensor_file(str(save_dir / "global_step3" / L.MODEL_FILE))
    assert model.keys() == engine.module.state_dict().keys()


def test_roundtrip_restores_everything_and_client_state_exactly(trained, monkeypatch):
    engine, save_dir, client = trained
    fresh = _engine(seed=7)

    # no pickle anywhere on the load path
    def no_pickle(*a, **k):
        raise AssertionError("pickle used while loading a checkpoint")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    path, got = fresh.load_checkpoint(str(save_dir))
    monkeypatch.undo()
    assert path == os.path.join(str(save_dir), "global_step3", L.MODEL_FILE)
    assert got.keys() == client.keys()
    assert got["epoch"] == 3 and got["optimizer"] == "mine" and got["global_steps"] == -1 and got["module"] == [1, 2]
    assert torch.equal(got["t"], client["t"])
    _same_state(engine, fresh)
    assert (fresh.global_steps, fresh.global_samples, fresh.micro_steps, fresh.skipped_steps) == (
        engine.global_steps,
        engine.global_samples,
        engine.micro_steps,
        engine.skipped_steps,
    )
    assert fresh.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    # training continues identically from both
    _train(engine, 1, seed=5)
    _train(fresh, 1, seed=5)
    _same_state(engine, fresh)


def test_load_module_only_and_flags(trained):
    _, save_dir, _ = trained
    fresh = _engine(seed=9)
    opt_before = fresh.zero_stage_impl.state_dict()
    path, client = fresh.load_checkpoint(str(save_dir), load_module_only=True)
    assert path is not None and client["epoch"] == 3
    assert fresh.global_steps == 0 and fresh.lr_scheduler.state_dict()["last_batch_iteration"] == -1
    assert fresh.zero_stage_impl.state_dict()["state"] == opt_before["state"] == {}
    saved, _ = read_tensor_file(str(save_dir / "global_step3" / L.MODEL_FILE))
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(v, saved[k])
    fresh2 = _engine(seed=9)
    fresh2.load_checkpoint(str(save_dir), load_lr_scheduler_states=False)
    assert fresh2.global_steps == 3 and fresh2.lr_scheduler.state_dict()["last_batch_iteration"] == -1


def test_save_latest_false_and_explicit_tag(trained):
    engine, save_dir, _ = trained
    assert (save_dir / "latest").read_text() == "global_step3"
    fresh = _engine(seed=3)
    path, client = fresh.load_checkpoint(str(save_dir), tag="extra")
    assert path.endswith(os.path.join("extra", L.MODEL_FILE)) and client == {}


def test_load_rules(trained, tmp_path, caplog):
    engine, save_dir, _ = trained
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "missing")):
        engine.load_checkpoint(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "old_tag").mkdir()
    with caplog.at_level(logging.WARNING, logger="dscore.checkpoint"):
        assert engine.load_checkpoint(str(empty)) == (None, None)
    assert "no 'latest' file" in caplog.text and "'old_tag' (incomplete)" in caplog.text
    with pytest.raises(CheckpointNotFoundError, match=r"'global_step99'.*complete tags: 'extra', 'global_step3'"):
        engine.load_checkpoint(str(save_dir), tag="global_step99")
    with pytest.raises(CheckpointError, match=r"tag='global_step3'"):
        engine.load_checkpoint(str(save_dir / "global_step3"))
    with pytest.raises(CheckpointError, match=r"file inside the checkpoint tag 'global_step3'"):
        engine.load_checkpoint(str(save_dir / "global_step3" / L.ENGINE_FILE))


def test_missing_or_truncated_shard_names_rank_and_file(tmp_path):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path), tag="t")
    rank_path = tmp_path / "t" / L.rank_file(0)
    data = rank_path.read_bytes()
    rank_path.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"missing rank_00000_states\.safetensors.*rank 0 of 1"):
        engine.load_checkpoint(str(tmp_path))
    rank_path.write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=r"rank_00000_states\.safetensors.*rank 0 of 1.*truncated"):
        engine.load_checkpoint(str(tmp_path))


def test_unsafe_client_state_refused_before_anything_is_written(tmp_path):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="good")
    before = sorted(os.listdir(tmp_path))
    import argparse

    with pytest.raises(CheckpointError, match=r"client_state\['args'\].*argparse\.Namespace"):
        engine.save_checkpoint(str(tmp_path), tag="bad", client_state={"args": argparse.Namespace(lr=1)})
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        engine.save_checkpoint(str(tmp_path), tag="../escape")
    with pytest.raises(CheckpointError, match="save_dir must be a non-empty path"):
        engine.save_checkpoint("", tag="x")
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / "latest").read_text() == "good"


def test_overwrite_same_tag_and_leftovers_of_a_killed_save(tmp_path):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="t")
    (tmp_path / ".t.tmp-deadbeef").mkdir()  # what a killed save leaves behind
    (tmp_path / ".t.tmp-deadbeef" / L.MODEL_FILE).write_bytes(b"partial")
    _train(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    fresh = _engine(seed=4)
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.global_steps == 2
    _same_state(engine, fresh)


def test_hooks_are_called(tmp_path):
    calls = []

    class Recorder:
        @dscore.hookimpl
        def dscore_checkpoint_saved(self, engine, save_dir, tag):
            calls.append(("saved", save_dir, tag, os.path.exists(os.path.join(save_dir, "latest"))))

        @dscore.hookimpl
        def dscore_checkpoint_loaded(self, engine, load_dir, tag):
            calls.append(("loaded", load_dir, tag, engine.global_steps))

    engine = _engine()
    engine.runtime.plugin_manager.register_object(Recorder(), "ckpt-recorder")  # this engine's manager only
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path))
    assert calls == [("saved", str(tmp_path), "global_step1", True), ("loaded", str(tmp_path), "global_step1", 1)]


def test_save_16bit_model(tmp_path):
    engine = _engine(extra={"bf16": {"enabled": True}})
    _train(engine, 1)
    assert engine.save_16bit_model(str(tmp_path)) is True
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    ref = engine.module.state_dict()
    assert state.keys() == ref.keys()
    for k in ref:
        assert state[k].dtype == torch.bfloat16 and torch.equal(state[k], ref[k].cpu())
    engine.save_16bit_model(str(tmp_path), save_filename="model.safetensors")
    st, _ = read_tensor_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(st[k], ref[k]) for k in ref)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "pytorch_model.bin"]


def test_export_uses_fp32_masters_and_casts(tmp_path):
    engine = _engine(extra={"bf16": {"enabled": True}})
    _train(engine, 4)  # the first step runs at the warmup's lr 0
    engine.save_checkpoint(str(tmp_path))
    masters = engine.zero_stage_impl.state_dict()["fp32_params"]
    fp32 = get_fp32_state_dict_from_checkpoint(str(tmp_path))
    assert set(masters) <= set(fp32)
    for name, m in masters.items():
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], m), name
        # the masters carry more precision than the bf16 module weights
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    (tmp_path / "out").mkdir()
    out = convert_checkpoint(str(tmp_path), str(tmp_path / "out"), dtype="fp16")
    assert out == str(tmp_path / "out" / "model.safetensors")
    half, _ = read_tensor_file(out)
    assert all(half[k].dtype == torch.float16 and torch.equal(half[k], fp32[k].half()) for k in fp32)
    with pytest.raises(CheckpointError, match="unknown export dtype 'int8'"):
        convert_checkpoint(str(tmp_path), str(tmp_path / "x.safetensors"), dtype="int8")


def test_cli_export_and_list_without_a_process_group(tmp_path, capsys):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ck"))
    engine.save_checkpoint(str(tmp_path / "ck"), tag="second", save_latest=False)
    out = tmp_path / "model.safetensors"
    # a fresh interpreter: no process group, no engine
    proc = subprocess.run(
        [sys.executable, "-m", "dscore", "checkpoint", "export", str(tmp_path / "ck"), str(out), "--dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    got, _ = read_tensor_file(str(out))
    ref = engine.module.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k].bfloat16()) for k in ref)
    assert (
        cli_main(["checkpoint", "export", str(tmp_path / "ck"), str(tmp_path / "s.safetensors"), "--tag", "second"])
        == 0
    )
    assert cli_main(["checkpoint", "export", str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["checkpoint", "list", str(tmp_path / "ck"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["latest"] == "global_step1"
    assert [(t["tag"], t["complete"], t["world_size"]) for t in info["tags"]] == [
        ("global_step1", True, 1),
        ("second", True, 1),
    ]
    assert cli_main(["checkpoint", "list", str(tmp_path / "ck")]) == 0
    assert "global_step1" in capsys.readouterr().out


def test_save_16bit_model_under_stage3_needs_gathering(tmp_path):
    engine = _engine(stage=3)
    with pytest.raises(CheckpointError, match="gather_16bit_weights_on_model_save"):
        engine.save_16bit_model(str(tmp_path))
    assert os.listdir(tmp_path) == []
    engine = _engine(
        stage=3, extra={"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    )
    assert engine.save_16bit_model(str(tmp_path)) is True
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    ref = _model(0).state_dict()  # the untrained weights, full shapes (not the stage-3 partitions)
    assert state.keys() == ref.keys()
    for k in ref:
        assert state[k].shape == ref[k].shape and torch.equal(state[k], ref[k]), k


@pytest.mark.parametrize("save_stage, load_stage", [(0, 2), (2, 0), (1, 3)])
def test_load_across_zero_stages(tmp_path, save_stage, load_stage):
    src = _engine(stage=save_stage)
    _train(src, 3)
    src.save_checkpoint(str(tmp_path))
    dst = _engine(seed=5, stage=load_stage)
    dst.load_checkpoint(str(tmp_path))
    a, b = src.zero_stage_impl.state_dict(), dst.zero_stage_impl.state_dict()
    assert sorted(a["param_names"]) == sorted(b["param_names"])  # stages may order them differently
    assert a["state"].keys() == b["state"].keys()
    for name, st in a["state"].items():
        for key, val in st.items():
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(b["state"][name][key])), (name, key)
    ma, mb = src.zero_stage_impl.module_state_dict(), dst.zero_stage_impl.module_state_dict()
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert dst.global_steps == 3 and dst.get_lr() == src.get_lr()


def test_durable_mode_fsyncs_and_roundtrips(tmp_path, monkeypatch):
    from dscore.persistence import tensorfile as _tensorfile

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(_tensorfile, "_WRITEBACK_CHUNK", 256)  # exercise the early-writeback path on small files
    monkeypatch.setenv(L.FSYNC_ENV, "1")
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    # every data file, the manifest, latest, and the directories
    assert len(synced) >= 5 + 1 + 1 + 2
    fresh = _engine(seed=2)
    fresh.load_checkpoint(str(tmp_path))
    _same_state(engine, fresh)
    synced.clear()
    monkeypatch.setenv(L.FSYNC_ENV, "0")
    engine.save_checkpoint(str(tmp_path), tag="fast")
    assert synced == []
