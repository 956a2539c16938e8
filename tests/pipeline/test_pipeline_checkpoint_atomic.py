"""The pipeline engine's checkpoints are saved like the standard engine's: atomically, with every phase agreed.

* A failed write on one rank (disk full) raises the same CheckpointError on every rank (2 gloo ranks, one
  per stage) and leaves the previous checkpoint of the same tag bit-for-bit and ``latest`` unchanged.
* A save killed mid-way (an exception that is not caught, as a kill) leaves only a hidden temporary folder,
  never loaded, removed by the next save of that tag.
* A tag folder without its ``_COMPLETE`` marker is refused naming the folder, unless it was written
  before pipeline saves had the marker; truncated files and the other engine's checkpoints are refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from typing import Any

import pipe_models as pm
import pytest
import torch

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.pipe import PipelineModule
from dscore.testing import run_distributed

GAS = 2


def _hashes(tag_dir: str) -> dict[str, str]:
    """``{file name: sha256}`` of every file of a tag folder."""
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        with open(os.path.join(tag_dir, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _train(engine: Any, step: int, dp: int = 0) -> None:
    engine.train_batch(iter([pm.micro_batch(step, dp, mb) for mb in range(GAS)]))


def _weights(pipe: PipelineModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def _broken_engine_state() -> dict[str, Any]:
    raise RuntimeError("the LR scheduler's state cannot be read")


class _DiskFull:
    """``torch.save`` replacement: writes half of the file, then fails with ENOSPC on layer files."""

    def __init__(self, real: Any, marker: str) -> None:
        self.real, self.marker, self.calls = real, marker, 0

    def __call__(self, obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if self.marker in os.path.basename(os.fspath(path)):
            self.calls += 1
            self.real(obj, path, *args, **kwargs)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))
        self.real(obj, path, *args, **kwargs)


def disk_full_on_one_rank(save_dir: str) -> dict[str, Any]:
    """Per rank (2 ranks = 2 stages): save tag ``t``, train, re-save ``t`` with a layer-file write failing on
    rank 1 and then on rank 0; check the first ``t`` survives; load it; then a normal round trip."""
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    pipe = PipelineModule(
        layers=pm.layer_specs(), num_stages=2, loss_fn=pm.loss_fn, partition_method="uniform",
        seed_layers=True, base_seed=pm.BASE_SEED,
    )
    engine, _, _, _ = dscore.initialize(model=pipe, config=pm.config(GAS))
    out: dict[str, Any] = {"rank": rank, "stage": pipe.stage_id, "errors": [], "checks": []}
    tag_dir = os.path.join(save_dir, "t")
    _train(engine, 0)
    engine.save_checkpoint(save_dir, tag="t", client_state={"step": 1})
    first = _weights(pipe)
    dist.barrier()
    saved = _hashes(tag_dir)
    out["first_files"] = sorted(saved)
    _train(engine, 1)
    moved = _weights(pipe)
    real_save = torch.save
    for failing in (1, 0):
        fake = _DiskFull(real_save, "layer_")
        if rank == failing:
            torch.save = fake  # the pipeline's files are written through torch.save
        try:
            engine.save_checkpoint(save_dir, tag="t", client_state={"step": 2})
        except CheckpointError as exc:
            out["errors"].append((type(exc).__name__, str(exc)))
        else:
            out["errors"].append(None)
        finally:
            torch.save = real_save
        dist.barrier()
        out["checks"].append(
            {
                "injected": fake.calls,
                "same_files": _hashes(tag_dir) == saved,
                "latest": _read(os.path.join(save_dir, "latest")),
                "entries": sorted(os.listdir(save_dir)),
            }
        )
        dist.barrier()
    # gathering the engine state fails on rank 0 only (after the stages' collectives): agreed as well
    if rank == 0:
        engine.state_for_checkpoint = _broken_engine_state
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except CheckpointError as exc:
        out["collect_error"] = (type(exc).__name__, str(exc))
    finally:
        engine.__dict__.pop("state_for_checkpoint", None)
    dist.barrier()
    out["collect_same_files"] = _hashes(tag_dir) == saved
    # the previous checkpoint of the tag loads bit for bit
    path, client = engine.load_checkpoint(save_dir)
    now = _weights(pipe)
    out["loaded_first"] = all(torch.equal(now[k], first[k]) for k in first) and any(
        not torch.equal(moved[k], first[k]) for k in first
    )
    out["loaded_path"], out["loaded_client"], out["loaded_steps"] = os.path.basename(path), client, engine.global_steps
    # a normal save of the same tag replaces it; a load after more training restores it exactly
    _train(engine, 2)
    engine.save_checkpoint(save_dir, tag="t", client_state={"step": 3, "t": torch.arange(3)})
    second = _weights(pipe)
    _train(engine, 3)
    path, client = engine.load_checkpoint(save_dir, tag="t")
    now = _weights(pipe)
    out["round_trip"] = all(torch.equal(now[k], second[k]) for k in second)
    out["round_trip_client"] = {"step": client["step"], "t": client["t"].tolist()}
    out["round_trip_steps"] = engine.global_steps
    dist.barrier()
    out["manifest"] = json.loads(_read(os.path.join(tag_dir, "_COMPLETE")))
    out["final_entries"] = sorted(os.listdir(save_dir))
    engine.close()
    return out


def test_write_error_on_one_rank_is_raised_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Any) -> None:
    save_dir = str(tmp_path / "ckpt")
    # a hang at a barrier instead of an agreed error would fail this by the job timeout, far above its run time
    results = run_distributed(disk_full_on_one_rank, 2, save_dir, timeout=240)
    assert [r["stage"] for r in results] == [0, 1]
    # stage 0 writes layers 0-2, its optimizer file and the engine file; stage 1 layer 4 and its optimizer file
    assert results[0]["first_files"] == [
        "_COMPLETE", "engine_states.pt", "layer_00-model_states.pt", "layer_01-model_states.pt",
        "layer_02-model_states.pt", "layer_04-model_states.pt", "optim_states-stage_00.pt", "optim_states-stage_01.pt",
    ]
    for attempt, failing in enumerate((1, 0)):
        errors = [r["errors"][attempt] for r in results]
        assert errors[0] is not None and errors[0] == errors[1], errors  # same type and text on both ranks
        kind, text = errors[0]
        assert kind == "CheckpointError"
        assert f"(on rank {failing})" in text and "No space left on device" in text, text
        assert "writing the files of pipeline checkpoint 't' into" in text and "layer_" in text, text
        assert results[failing]["checks"][attempt]["injected"] == 1
        assert results[1 - failing]["checks"][attempt]["injected"] == 0
        for r in results:
            check = r["checks"][attempt]
            assert check["same_files"], f"the previous checkpoint 't' changed after the failed save on rank {failing}"
            assert check["latest"] == "t"
            assert check["entries"] == ["latest", "t"]  # the partial temporary folder was removed
    errors = [r.get("collect_error") for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0][0] == "CheckpointError" and "(on rank 0)" in errors[0][1]
    assert "RuntimeError: the LR scheduler's state cannot be read" in errors[0][1]
    assert all(r["collect_same_files"] for r in results)
    for r in results:
        assert r["loaded_first"] and r["loaded_path"] == "t" and r["loaded_client"] == {"step": 1}
        assert r["loaded_steps"] == 1
        assert r["round_trip"] and r["round_trip_client"] == {"step": 3, "t": [0, 1, 2]}
        assert r["round_trip_steps"] == 2
        assert r["final_entries"] == ["latest", "t"]
    manifest = results[0]["manifest"]
    assert manifest["kind"] == "pipeline" and manifest["world_size"] == 2 and manifest["num_stages"] == 2
    assert manifest["files"]["layer_04-model_states.pt"]["rank"] == 1
    assert manifest["files"]["engine_states.pt"]["rank"] == 0


# ----------------------------------------------------------------------------------- one rank, in process


@pytest.fixture
def one_stage() -> Any:
    import dscore

    pipe = PipelineModule(
        layers=pm.layer_specs(), num_stages=1, loss_fn=pm.loss_fn, seed_layers=True, base_seed=pm.BASE_SEED,
        partition_method="uniform",
    )
    engine, _, _, _ = dscore.initialize(model=pipe, config=pm.config(GAS))
    yield engine, pipe
    engine.close()


class _Killed(BaseException):
    """Stands for the process being killed: nothing in the save may catch it."""


def test_a_save_killed_mid_way_leaves_the_previous_checkpoint_and_is_never_loaded(
    one_stage: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, pipe = one_stage
    save_dir = str(tmp_path)
    _train(engine, 0)
    engine.save_checkpoint(save_dir, tag="t")
    first, saved = _weights(pipe), _hashes(str(tmp_path / "t"))
    _train(engine, 1)
    real_save = torch.save

    def killed_at_layer_2(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, path, *args, **kwargs)
        if "layer_02" in os.fspath(path):
            raise _Killed()

    monkeypatch.setattr(torch, "save", killed_at_layer_2)
    with pytest.raises(_Killed):
        engine.save_checkpoint(save_dir, tag="t")
    monkeypatch.setattr(torch, "save", real_save)
    leftovers = [n for n in os.listdir(save_dir) if n.startswith(".t.tmp-")]
    assert len(leftovers) == 1 and "layer_00-model_states.pt" in os.listdir(tmp_path / leftovers[0])
    assert _hashes(str(tmp_path / "t")) == saved and _read(str(tmp_path / "latest")) == "t"
    with pytest.raises(CheckpointError, match="starts with '.'"):
        engine.load_checkpoint(save_dir, tag=leftovers[0])
    assert engine.load_checkpoint(save_dir)[0] == str(tmp_path / "t")
    assert all(torch.equal(v, first[k]) for k, v in _weights(pipe).items())
    # the next save of the tag clears the leftover and succeeds
    engine.save_checkpoint(save_dir, tag="t")
    assert sorted(os.listdir(save_dir)) == ["latest", "t"]


def test_tag_folder_without_marker_is_refused_unless_it_predates_the_marker(
    one_stage: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine, pipe = one_stage
    _train(engine, 0)
    engine.save_checkpoint(str(tmp_path), tag="t", client_state={"a": 1})
    saved = _weights(pipe)
    tag_dir = tmp_path / "t"
    os.unlink(tag_dir / "_COMPLETE")
    with pytest.raises(CheckpointNotFoundError, match=r"tag 't'.*is incomplete \(no valid _COMPLETE marker"):
        engine.load_checkpoint(str(tmp_path))
    # a folder written before pipeline saves had the marker: same files, engine state without the marker key
    state = torch.load(tag_dir / "engine_states.pt", weights_only=True)
    del state["complete_marker"]
    torch.save(state, tag_dir / "engine_states.pt")
    _train(engine, 1)
    with caplog.at_level("WARNING", logger="dscore.pipe.checkpoint"):
        path, client = engine.load_checkpoint(str(tmp_path))
    assert path == str(tag_dir) and client == {"a": 1}
    assert "has no _COMPLETE marker" in caplog.text
    assert all(torch.equal(v, saved[k]) for k, v in _weights(pipe).items())
    # ... whose missing file is named
    os.unlink(tag_dir / "layer_01-model_states.pt")
    with pytest.raises(CheckpointNotFoundError, match=r"no _COMPLETE marker\) is missing layer_01-model_states\.pt"):
        engine.load_checkpoint(str(tmp_path))


def test_truncated_file_and_client_state_and_other_engine_checkpoints_are_refused(
    one_stage: Any, tmp_path: Any
) -> None:
    from dscore.checkpoint import get_fp32_state_dict_from_checkpoint
    from dscore.pipe import load_into_layers

    engine, pipe = one_stage
    _train(engine, 0)
    with pytest.raises(CheckpointError, match=r"client_state\['bad'\]"):
        engine.save_checkpoint(str(tmp_path), tag="t", client_state={"bad": object()})
    assert os.listdir(tmp_path) == []  # refused before anything was written
    engine.save_checkpoint(str(tmp_path), tag="t")
    layer = tmp_path / "t" / "layer_01-model_states.pt"
    with open(layer, "r+b") as f:
        f.truncate(os.path.getsize(layer) - 1)
    with pytest.raises(CheckpointError, match=r"layer_01-model_states\.pt \(written by rank 0 of 1\).*truncated"):
        engine.load_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="truncated"):
        load_into_layers(pm.PlainNet().pipeline_layers(), str(tmp_path))
    # the standard engine's readers name the pipeline's
    with pytest.raises(CheckpointError, match="written by the pipeline engine.*dscore.pipe.load_into_layers"):
        get_fp32_state_dict_from_checkpoint(str(tmp_path))
    # and the pipeline refuses a standard-engine checkpoint
    manifest = json.loads(_read(str(tmp_path / "t" / "_COMPLETE")))
    del manifest["kind"]
    (tmp_path / "t" / "_COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="written by the standard engine.*reads pipeline checkpoints"):
        engine.load_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="is a checkpoint tag directory"):
        engine.load_checkpoint(str(tmp_path / "t"))
