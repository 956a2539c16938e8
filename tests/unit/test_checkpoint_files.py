"""The checkpoint file layer without an engine: safetensors I/O, the state encoding, tags, load-path rules."""

from __future__ import annotations

import json
import math
import os
import struct
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import load_file, save_file

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import savedir as L
from dscore.persistence.tensorfile import read_header, read_tensor_file, write_tensor_file
from dscore.persistence.tree import decode, encode


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "h": torch.randn(7, generator=g).half(),
        "b": torch.randn(2, 3, generator=g).bfloat16(),
        "i": torch.arange(5, dtype=torch.int64),
        "u": torch.tensor([1, 2, 250], dtype=torch.uint8),
        "flag": torch.tensor(True),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(10.0)[::3],
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def test_tensor_file_roundtrip_and_interop_with_safetensors(tmp_path):
    ts = _tensors()
    ours = str(tmp_path / "ours.safetensors")
    size = write_tensor_file(ours, ts, {"k": "v"})
    assert size == os.path.getsize(ours)
    # the safetensors package reads what we write ...
    theirs_view = load_file(ours)
    for k, t in ts.items():
        assert theirs_view[k].dtype == t.dtype and torch.equal(theirs_view[k], t), k
    # ... and we read what it writes, metadata included
    theirs = str(tmp_path / "theirs.safetensors")
    save_file({k: v.contiguous() for k, v in ts.items()}, theirs, metadata={"m": "1"})
    for path, meta in ((ours, {"k": "v"}), (theirs, {"m": "1"})):
        back, got_meta = read_tensor_file(path)
        assert got_meta == meta
        assert set(back) == set(ts)
        for k, t in ts.items():
            assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), (path, k)
            # every tensor owns its storage (no view pinning a whole-file buffer)
            assert back[k].untyped_storage().nbytes() == t.numel() * t.element_size()


def test_tensor_file_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(CheckpointError, match=r"'z'.*complex"):
        write_tensor_file(str(tmp_path / "c.safetensors"), {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(CheckpointError, match=r"'n'.*expected a torch.Tensor"):
        write_tensor_file(str(tmp_path / "c.safetensors"), {"n": 3})  # type: ignore[dict-item]


def test_truncated_and_corrupt_files_are_errors_naming_the_file(tmp_path):
    path = str(tmp_path / "x.safetensors")
    write_tensor_file(path, {"a": torch.randn(100)})
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])
    with pytest.raises(CheckpointError, match=r"x\.safetensors.*(truncated|corrupt)"):
        read_tensor_file(path)
    open(path, "wb").write(b"\x05\x00")
    with pytest.raises(CheckpointError, match="x.safetensors"):
        read_header(path)
    header = b"not json"
    open(path, "wb").write(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="not JSON"):
        read_header(path)
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        read_tensor_file(str(tmp_path / "nope.safetensors"))


def test_encode_decode_roundtrip_exact():
    value = {
        "epoch": 3,
        "optimizer": "mine",
        "ratio": 0.1,
        "bad": float("nan"),
        "inf": float("-inf"),
        "flags": [True, False, None],
        "pair": (1, "a", (2.0,)),
        "by_int": {0: "zero", 1: {"t": torch.ones(2)}},
        "$weird": {"$tensor": "not a tensor"},
        "od": OrderedDict(b=1, a=2),
        "t": torch.arange(4).reshape(2, 2),
        "big": 2**70,
    }
    tensors: dict[str, torch.Tensor] = {}
    tree = encode(value, root="client_state", tensor_prefix="client/", tensors=tensors)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # strictly JSON
    back = decode(tree, tensors, source="test")
    assert set(back) == set(value)
    assert back["pair"] == (1, "a", (2.0,)) and isinstance(back["pair"], tuple)
    assert back["by_int"][0] == "zero" and torch.equal(back["by_int"][1]["t"], torch.ones(2))
    assert back["$weird"] == {"$tensor": "not a tensor"}
    assert math.isnan(back["bad"]) and back["inf"] == float("-inf")
    assert back["od"] == {"b": 1, "a": 2} and list(back["od"]) == ["b", "a"]
    assert torch.equal(back["t"], value["t"])
    assert back["big"] == 2**70
    for k in ("epoch", "optimizer", "ratio", "flags"):
        assert back[k] == value[k] and type(back[k]) is type(value[k])


class _Custom:
    pass


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"args": _Custom()}, r"client_state\['args'\].*_Custom"),
        ({"x": [1, {"y": {1, 2}}]}, r"client_state\['x'\]\[1\]\['y'\].*set"),
        ({"fn": print}, r"client_state\['fn'\]"),
        ({(1, 2): "tuple key"}, r"dict key \(1, 2\)"),
        ({"s": torch.zeros(2).to_sparse()}, r"client_state\['s'\].*sparse"),
    ],
)
def test_encode_refuses_unsafe_types_naming_the_path(bad, where):
    with pytest.raises(CheckpointError, match=where) as info:
        encode(bad, root="client_state", tensor_prefix="c/", tensors={})
    assert "allowed" in str(info.value) or "cannot be stored" in str(info.value)


def test_encode_refuses_cycles():
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(CheckpointError, match="cycle"):
        encode(loop, root="client_state", tensor_prefix="c/", tensors={})


@pytest.mark.parametrize("tag", ["", ".", "..", ".hidden", "a/b", "latest", "x" * 300])
def test_invalid_tags(tag):
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        L.validate_tag(tag)


def test_valid_tags():
    assert L.validate_tag(5) == "5"
    assert L.validate_tag("global_step10") == "global_step10"


def _fake_tag(save_dir, tag, complete=True):
    d = save_dir / tag
    d.mkdir(parents=True)
    (d / L.MODEL_FILE).write_bytes(b"x")
    if complete:
        (d / L.COMPLETE_FILE).write_text(json.dumps({"format": L.FORMAT, "format_version": 1, "files": {}}))
    return d


def test_resolve_rules(tmp_path):
    save = tmp_path / "ckpt"
    with pytest.raises(CheckpointNotFoundError, match=str(save)):
        L.resolve_tag(str(save), None)
    save.mkdir()
    assert L.resolve_tag(str(save), None) is None  # fresh start
    _fake_tag(save, "global_step10")
    _fake_tag(save, "global_step2")
    _fake_tag(save, "broken", complete=False)
    assert [t for t, _ in L.list_tags(str(save))] == ["broken", "global_step2", "global_step10"]
    assert L.resolve_tag(str(save), None) is None
    assert L.resolve_tag(str(save), "global_step2") == "global_step2"
    with pytest.raises(CheckpointNotFoundError, match=r"'nope'.*complete tags: 'global_step2', 'global_step10'"):
        L.resolve_tag(str(save), "nope")
    with pytest.raises(CheckpointNotFoundError, match=r"'broken'.*incomplete.*complete tags: 'global_step2'"):
        L.resolve_tag(str(save), "broken")
    (save / L.LATEST_FILE).write_text("global_step10")
    assert L.resolve_tag(str(save), None) == "global_step10"
    (save / L.LATEST_FILE).write_text("broken\n")
    with pytest.raises(CheckpointNotFoundError, match=r"named by .*latest.*incomplete"):
        L.resolve_tag(str(save), None)
    # a tag folder or a file inside one: suggest the right call
    with pytest.raises(CheckpointError, match=r"tag='global_step10'") as info:
        L.resolve_tag(str(save / "global_step10"), None)
    assert f"load_checkpoint({str(save)!r}" in str(info.value)
    with pytest.raises(CheckpointError, match=r"file inside the checkpoint tag 'global_step10'.*tag='global_step10'"):
        L.resolve_tag(str(save / "global_step10" / L.MODEL_FILE), None)


def test_atomic_write_and_exchange(tmp_path):
    p = tmp_path / "latest"
    L.atomic_write_bytes(str(p), b"a")
    L.atomic_write_bytes(str(p), b"bb")
    assert p.read_bytes() == b"bb"
    assert sorted(os.listdir(tmp_path)) == ["latest"]
    old, new = tmp_path / "t", tmp_path / ".t.tmp-1"
    old.mkdir()
    (old / "f").write_text("old")
    new.mkdir()
    (new / "f").write_text("new")
    aside = L.exchange_or_rename(str(new), str(old))
    assert (old / "f").read_text() == "new"
    assert aside is not None and open(os.path.join(aside, "f")).read() == "old"
    fresh = tmp_path / ".u.tmp-2"
    fresh.mkdir()
    assert L.exchange_or_rename(str(fresh), str(tmp_path / "u")) is None
    assert (tmp_path / "u").is_dir() and not fresh.exists()


def test_remove_stale_only_touches_the_tags_leftovers(tmp_path):
    for name in (".t.tmp-abc", ".t.old-def", ".other.tmp-x", "t", "latest.tmp-9"):
        (tmp_path / name).mkdir()
    removed = L.remove_stale(str(tmp_path), "t")
    assert sorted(removed) == [".t.old-def", ".t.tmp-abc", "latest.tmp-9"]
    assert sorted(os.listdir(tmp_path)) == [".other.tmp-x", "t"]


def test_durable_switch(monkeypatch):
    monkeypatch.setenv(L.FSYNC_ENV, "0")
    assert not L.durable()
    monkeypatch.setenv(L.FSYNC_ENV, "1")
    assert L.durable()
    monkeypatch.delenv(L.FSYNC_ENV)
    assert not L.durable()  # default: like torch.save (kill-safe through renames, not power-loss durable)


def test_cli_module_is_torch_free_at_import():
    import subprocess
    import sys

    code = "import sys, dscore.cli.checkpoint as c; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
