"""The async_io op (libaio), compiled for real with ninja, and its ``aio`` config section.

Error paths use real file systems: a 1 MiB tmpfs for ENOSPC and a read-only tmpfs for EROFS (root
bypasses permission bits, not a read-only mount). Mounts are removed at teardown.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dscore.config import load_config
from dscore.errors import ConfigError, DscoreError

pytestmark = pytest.mark.slow

ALIGN = 4096


@pytest.fixture(scope="module")
def aio(aio_op):  # type: ignore[no-untyped-def]
    """The ``dscore_plugins.ops.aio`` module with the op compiled (once) into the session cache."""
    return aio_op


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _unaligned(n: int) -> torch.Tensor:
    """A uint8 tensor whose data pointer is NOT 4096-aligned (forces the bounce-buffer path)."""
    base = torch.empty(n + ALIGN + 1, dtype=torch.uint8)
    shift = (-base.data_ptr()) % ALIGN + 1
    t = base[shift : shift + n]
    assert t.data_ptr() % ALIGN != 0
    return t


@contextlib.contextmanager
def _tmpfs(where: Path, *options: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join(("size=1m", *options))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    ("nbytes", "offset", "buffer"),
    [
        (1, 0, "plain"),  # smaller than a block: buffered
        (4095, 3, "plain"),  # unaligned offset: the whole request buffered
        (ALIGN, 0, "aligned"),  # exactly one O_DIRECT block
        (1_000_003, 0, "aligned"),  # O_DIRECT body + buffered tail, several blocks
        (1_000_003, 5 * ALIGN, "unaligned"),  # O_DIRECT through bounce buffers + tail
        (3 * 65536 + 17, 12345, "aligned"),  # unaligned offset, aligned memory
    ],
)
def test_round_trip_odd_sizes_and_offsets(aio, tmp_path: Path, nbytes: int, offset: int, buffer: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "data.swp"
    src = {"plain": lambda: torch.empty(nbytes, dtype=torch.uint8), "aligned": lambda: aio.aligned_empty(nbytes, torch.uint8),
           "unaligned": lambda: _unaligned(nbytes)}[buffer]()
    src.copy_(_random(nbytes, nbytes))
    direct = offset % ALIGN == 0 and nbytes >= ALIGN
    with aio.AsyncIOHandle(block_size=65536, queue_depth=4, intra_op_parallelism=2) as h:
        assert h.async_pwrite(src, path, offset) >= 1
        assert h.wait() == 1
        dst = _unaligned(nbytes) if buffer == "unaligned" else torch.zeros(nbytes, dtype=torch.uint8)
        h.async_pread(dst, path, offset)
        assert h.wait() == 1
        assert (h.direct_requests, h.buffered_requests) == ((2, 0) if direct else (0, 2))
    assert torch.equal(dst, src)
    assert path.stat().st_size == offset + nbytes
    assert path.read_bytes()[offset:] == src.numpy().tobytes()  # what is on disk, read without the op


@pytest.mark.parametrize(
    "settings",
    [
        {"queue_depth": 8, "intra_op_parallelism": 3},
        {"queue_depth": 2, "single_submit": True, "overlap_events": False},
        {"queue_depth": 32, "overlap_events": False, "thread_count": 2},
    ],
)
def test_many_requests_in_flight_share_one_file(aio, tmp_path: Path, settings: dict) -> None:  # type: ignore[no-untyped-def]
    """64 tensors of odd sizes (fp32, bf16, int64) at packed aligned offsets of one file, all queued
    before one wait(); then all read back the same way."""
    g = torch.Generator().manual_seed(7)
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    tensors = [torch.randn(int(n), generator=g).to(dtypes[i % 3]) for i, n in enumerate(torch.randint(1, 9000, (64,), generator=g))]
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += -(-t.nbytes // ALIGN) * ALIGN
    path = tmp_path / "many.swp"
    with aio.AsyncIOHandle(block_size=8192, **settings) as h:
        for t, off in zip(tensors, offsets):
            h.async_pwrite(t, path, off)
        assert h.wait() == 64
        back = [torch.empty_like(t) for t in tensors]
        for t, off in zip(back, offsets):
            h.async_pread(t, path, off)
        assert h.wait() == 64
        assert h.wait() == 0  # counts are per wait()
    for a, b in zip(tensors, back):
        assert torch.equal(a, b)


def test_handle_settings_come_from_the_loaded_config(aio) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config({"train_batch_size": 8, "aio": {"block_size": 262144, "queue_depth": 4, "thread_count": 2,
                                                      "single_submit": True, "overlap_events": False}})
    assert any("thread_count" in w and "migrated" in w for w in cfg.warnings)
    assert not any("'aio'" in w for w in cfg.warnings)  # the section is used (NVMe offload): no note
    with aio.AsyncIOHandle.from_config(cfg.aio) as h:
        assert (h.block_size, h.queue_depth, h.intra_op_parallelism, h.single_submit, h.overlap_events) == (
            262144, 4, 2, True, False)
    with aio.AsyncIOHandle.from_config(None) as h:  # DeepSpeed 0.19.8 defaults
        assert (h.block_size, h.queue_depth, h.intra_op_parallelism, h.single_submit, h.overlap_events) == (
            1048576, 8, 1, False, True)


# ---------------------------------------------------------------- errors
def test_read_past_the_end_is_an_error(aio, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "short.swp"
    path.write_bytes(bytes(3 * ALIGN + 5))
    with aio.AsyncIOHandle(block_size=ALIGN) as h:
        with pytest.raises(aio.AsyncIOError, match=r"read past the end of the file: it has 12293 bytes") as ei:
            h.async_pread(torch.empty(4 * ALIGN, dtype=torch.uint8), path, 0)
        assert ei.value.filename == str(path) and ei.value.operation == "read"
        assert h.inflight() == 0


@pytest.mark.parametrize(
    ("size", "queue_depth", "threads"),
    [(5 * ALIGN + 100, 2, 1), (5 * ALIGN + 100, 8, 2), (5 * ALIGN, 4, 2), (ALIGN + 1, 8, 4)],
)
def test_end_of_file_reached_during_the_read_is_an_error(aio, tmp_path: Path, size: int, queue_depth: int, threads: int) -> None:  # type: ignore[no-untyped-def]
    """The file shrinks after the size check: the C++ side reports the short read, never a partial one.

    Several pieces of the request reach the end of the file (the one holding it and every later one) and
    complete in any order; whichever is recorded first, the message names where the file ends (fstat), so
    the outcome does not depend on completion order (issue 33 item 14: it used to name the piece's offset).
    """
    path = tmp_path / "shrinks.swp"
    path.write_bytes(bytes(8 * ALIGN))
    with aio.AsyncIOHandle(block_size=ALIGN, queue_depth=queue_depth, intra_op_parallelism=threads) as h:
        buf = aio.aligned_empty(8 * ALIGN, torch.uint8)
        fd_b = os.open(path, os.O_RDONLY)
        fd_d = os.open(path, os.O_RDONLY | os.O_DIRECT)
        os.truncate(path, size)
        h._h.submit(True, buf.data_ptr(), buf.nbytes, 0, fd_d, fd_b, str(path))
        with pytest.raises(aio.AsyncIOError, match=rf"short read: the file ends at byte {size}\b") as ei:
            h.wait()
        assert ei.value.filename == str(path) and ei.value.errno is None


def test_missing_file_and_folder(aio, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with aio.AsyncIOHandle() as h:
        with pytest.raises(aio.AsyncIOError, match=r"read .* of '.*nope.swp' failed: No such file") as ei:
            h.async_pread(torch.empty(10), tmp_path / "nope.swp")
        assert ei.value.errno == errno.ENOENT
        with pytest.raises(aio.AsyncIOError, match=r"write .*no/such/dir/x.swp' failed: No such file"):
            h.async_pwrite(torch.empty(10), tmp_path / "no" / "such" / "dir" / "x.swp")


def test_full_device_raises_enospc(aio, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with _tmpfs(tmp_path / "tiny") as mnt:
        big = aio.aligned_empty(2 << 20, torch.uint8).fill_(7)  # 2 MiB into 1 MiB
        with aio.AsyncIOHandle(block_size=65536, queue_depth=4, intra_op_parallelism=2) as h:
            # direct: the range is allocated before submission, so the error comes at once
            with pytest.raises(aio.AsyncIOError, match=r"write .*full.swp' failed: No space left on device .*full") as ei:
                h.async_pwrite(big, mnt / "full.swp", 0)
            assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(mnt / "full.swp")
            assert h.inflight() == 0
            # buffered (unaligned offset): the kernel write itself fails, reported by wait()
            h.async_pwrite(big, mnt / "full2.swp", 1)
            with pytest.raises(aio.AsyncIOError, match=r"write .*full2.swp' failed: No space left on device") as ei:
                h.wait()
            assert ei.value.errno == errno.ENOSPC
            (mnt / "full2.swp").unlink()
        # one request in flight: no preallocation, so ENOSPC comes from the completed direct iocbs
        with aio.AsyncIOHandle(block_size=65536, queue_depth=1) as h1:
            h1.async_pwrite(big, mnt / "full3.swp", 0)
            with pytest.raises(aio.AsyncIOError, match=r"write .*full3.swp' failed: No space left on device") as ei:
                h1.wait()
            assert ei.value.errno == errno.ENOSPC and h1.direct_requests == 1


def test_read_only_file_system_raises_erofs(aio, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with _tmpfs(tmp_path / "ro") as mnt:
        (mnt / "old.swp").write_bytes(bytes(ALIGN))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with aio.AsyncIOHandle() as h:
            for name in ("old.swp", "new.swp"):  # an existing file, and creating one
                with pytest.raises(aio.AsyncIOError, match=r"write .* failed: Read-only file system .*read-only") as ei:
                    h.async_pwrite(aio.aligned_empty(ALIGN, torch.uint8), mnt / name, 0)
                assert ei.value.errno == errno.EROFS and ei.value.filename == str(mnt / name)
            # reading still works
            out = torch.ones(ALIGN, dtype=torch.uint8)
            h.sync_pread(out, mnt / "old.swp")
            assert int(out.sum()) == 0


def test_bad_arguments_are_refused(aio, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"aio.use_gds: .*GPUDirect Storage is not supported"):
        aio.AsyncIOHandle(use_gds=True)
    with pytest.raises(ConfigError, match=r"aio.block_size: .*multiple of 4096"):
        aio.AsyncIOHandle(block_size=1000)
    with pytest.raises(ConfigError, match=r"aio.queue_depth"):
        aio.AsyncIOHandle(queue_depth=0)
    with pytest.raises(ConfigError, match=r"aio.blok_size: unknown key"):
        aio.AsyncIOHandle.from_config({"blok_size": 4096})
    with aio.AsyncIOHandle() as h:
        with pytest.raises(DscoreError, match="contiguous"):
            h.async_pwrite(torch.empty(4, 4).t(), tmp_path / "x")
        with pytest.raises(DscoreError, match="file_offset must be an integer >= 0"):
            h.async_pwrite(torch.empty(4), tmp_path / "x", -1)
    h.close()  # idempotent
    if torch.cuda.is_available():  # pinned memory is plain host memory to the op
        pinned = aio.aligned_empty(3 * ALIGN + 1, torch.uint8, pin_memory=True)
        assert pinned.is_pinned() and pinned.data_ptr() % ALIGN == 0
        with aio.AsyncIOHandle() as h2:
            pinned.copy_(_random(pinned.numel(), 3))
            h2.sync_pwrite(pinned, tmp_path / "pinned")
            back = aio.aligned_empty(pinned.numel(), torch.uint8, pin_memory=True)
            h2.sync_pread(back, tmp_path / "pinned")
            assert torch.equal(back, pinned)
    else:
        with pytest.raises(DscoreError, match="pinned memory"):
            aio.aligned_empty(10, pin_memory=True)
    with pytest.raises(DscoreError, match="closed"):
        h.async_pread(torch.empty(4), tmp_path / "x")


# ---------------------------------------------------------------- config section + builder
def test_aio_config_section_defaults_and_validation() -> None:
    cfg = load_config({"train_batch_size": 8})
    assert cfg.aio.model_dump() == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                                    "single_submit": False, "overlap_events": True, "use_gds": False}
    assert not any("aio" in w for w in cfg.warnings)  # absent: no note
    for bad, where in [({"use_gds": True}, "aio.use_gds"), ({"blok_size": 4096}, "aio.blok_size"),
                       ({"block_size": 5000}, "aio.block_size"), ({"queue_depth": True}, "aio.queue_depth"),
                       ({"thread_count": 2, "intra_op_parallelism": 2}, "aio.thread_count")]:
        with pytest.raises(ConfigError) as ei:
            load_config({"train_batch_size": 8, "aio": bad})
        assert where in str(ei.value), (bad, str(ei.value))
    assert load_config({"train_batch_size": 8, "aio": None}).aio.queue_depth == 8


def test_missing_libaio_is_named_by_ops_list_and_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A compiler that sees neither libaio.h nor libaio.so: `ops list --check` and `ops build` say which
    is missing and how to install it (nothing is compiled)."""
    from dscore.cli.main import main as cli_main

    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\ncase "$1" in --version) echo "fake-c++ 1.0";; -print-file-name=*) echo libaio.so;;\n'
                    '*) cat >/dev/null; exit 1;; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    assert cli_main(["ops", "list", "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reason = lines[next(i for i, line in enumerate(lines) if line.startswith("async_io")) + 1]
    assert "NOT buildable" in reason and "libaio.h" in reason and "libaio.so" in reason and "libaio-dev" in reason
    assert cli_main(["ops", "build", "async_io"]) == 1
    assert "FAILED   async_io: not compatible here: the header libaio.h" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()


def test_cli_build_and_report_show_async_io(
    aio, ops_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]  # type: ignore[no-untyped-def]
) -> None:
    from dscore.cli.main import main as cli_main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ops_cache))
    monkeypatch.setenv("DS_BUILD_OPS", "0")
    monkeypatch.setenv("DS_BUILD_AIO", "1")
    assert cli_main(["ops", "build"]) == 0
    out = capsys.readouterr().out
    assert "built    async_io" in out and "cpu_adam" not in out  # DS_BUILD_AIO alone selects it
    assert cli_main(["report"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("async_io"))
    assert "[OKAY]" in row and "yes" in row and "libaio" in row
