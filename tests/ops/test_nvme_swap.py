"""NVMeSwapManager (plugins/dscore_plugins/zero/nvme_swap.py) on the real async_io op, on its own (the
ZeRO NVMe offload built on it is tested in test_nvme_optimizer.py, test_nvme_params.py and
tests/distributed/test_nvme_offload.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dscore.errors import DscoreError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swap(aio_op):  # type: ignore[no-untyped-def]
    """The nvme_swap module, with the async_io op compiled (once) into the session cache."""
    from dscore_plugins.zero import nvme_swap

    return nvme_swap


def _chunks(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1,), (1000,), (257, 33), (4096,), (3, 5, 7), (100_003,)]
    return {f"group{i}.exp_avg": torch.randn(s, generator=g) for i, s in enumerate(shapes)}


def test_pipelined_steps_match_in_memory_reference(swap, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three 'optimizer steps' over 6 chunks: swap in chunk i (prefetched), prefetch i+1, update, swap
    out asynchronously — the result equals the same updates done in memory, bit for bit."""
    ref = _chunks(0)
    names = list(ref)
    with swap.NVMeSwapManager(tmp_path, aio={"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 2},
                              buffer_count=2, run_id="t1") as mgr:
        for name, t in ref.items():
            mgr.swap_out(name, t.clone(), async_op=True)
        mgr.wait_writes()
        assert sorted(p.name for p in mgr.folder.iterdir()) == ["000000.swp", "000001.swp", "000002.swp",
                                                               "000003.swp", "000004.swp", "000005.swp", "owner.json"]
        assert mgr.bytes_on_disk() == sum(t.nbytes for t in ref.values())
        for step in range(3):
            mgr.prefetch(names[0])
            for i, name in enumerate(names):
                cur = mgr.swap_in(name)
                if i + 1 < len(names):
                    mgr.prefetch(names[i + 1])  # overlaps the update below
                assert cur.shape == ref[name].shape and cur.dtype == torch.float32
                cur.mul_(0.9).add_(step + 1.0)
                ref[name].mul_(0.9).add_(step + 1.0)
                mgr.swap_out(name, cur, async_op=True)
            mgr.wait_writes()
        for name in names:
            assert torch.equal(mgr.swap_in(name), ref[name])
        out = torch.empty_like(ref[names[2]])
        assert mgr.swap_in(names[2], out=out) is out and torch.equal(out, ref[names[2]])
        mgr.remove(names[0])
        assert names[0] not in mgr and not (mgr.folder / "000000.swp").exists()
        folder = mgr.folder
    assert not folder.exists() and not folder.parent.exists()  # rank and run folders gone after close


def test_misuse_gives_clear_errors(swap, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    mgr = swap.NVMeSwapManager(tmp_path, buffer_count=1, run_id="t2")
    mgr.swap_out("a", torch.ones(10))
    mgr.swap_out("b", torch.ones(3, dtype=torch.float64))
    with pytest.raises(DscoreError, match=r"no tensor named 'c' is swapped out \(held: a, b\)"):
        mgr.swap_in("c")
    mgr.prefetch("a")
    with pytest.raises(DscoreError, match=r"buffer_count=1 read-ahead buffers hold tensors not swapped in yet \(a\)"):
        mgr.prefetch("b")
    with pytest.raises(DscoreError, match=r"out has shape \(4,\)"):
        mgr.swap_in("a", out=torch.empty(4))
    assert torch.equal(mgr.swap_in("a"), torch.ones(10))
    mgr.swap_out("a", torch.arange(5.0))  # a new size replaces the file
    assert torch.equal(mgr.swap_in("a"), torch.arange(5.0))
    with pytest.raises(DscoreError, match="already exists"):
        swap.NVMeSwapManager(tmp_path, run_id="t2")  # same run and rank
    other = swap.NVMeSwapManager(tmp_path, run_id="t2", rank=1)  # another rank of the same run
    mgr.close()
    assert (tmp_path / "dscore-swap-t2").exists() and not mgr.folder.exists()
    other.close()
    assert not (tmp_path / "dscore-swap-t2").exists()
    with pytest.raises(DscoreError, match="is closed"):
        mgr.swap_in("a")
    # a swap file cut short behind the manager's back: an error, never a partial tensor
    with swap.NVMeSwapManager(tmp_path, run_id="t3") as m3:
        m3.swap_out("x", torch.randn(5000))
        os.truncate(m3.entry("x").path, 100)
        from dscore_plugins.ops.aio import AsyncIOError

        with pytest.raises(AsyncIOError, match=r"read past the end of the file: it has 100 bytes"):
            m3.swap_in("x")


def test_full_folder_raises_enospc(swap, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import errno

    from dscore_plugins.ops.aio import AsyncIOError

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        with swap.NVMeSwapManager(mnt, run_id="full") as mgr:
            mgr.swap_out("small", torch.ones(1000))
            with pytest.raises(AsyncIOError, match=r"write .*000001.swp' failed: No space left on device") as ei:
                mgr.swap_out("big", torch.ones(1 << 19))  # 2 MiB
            assert ei.value.errno == errno.ENOSPC
            with pytest.raises(DscoreError, match=r"'big' is not available: its swap-out failed \(.*No space left"):
                mgr.swap_in("big")
            assert torch.equal(mgr.swap_in("small"), torch.ones(1000))
            # an asynchronous swap-out failing mid-write (one request in flight: no preallocation)
            with swap.NVMeSwapManager(mnt, run_id="full-qd1", aio={"queue_depth": 1}) as m1:
                m1.swap_out("big2", torch.ones(1 << 19), async_op=True)
                with pytest.raises(AsyncIOError, match="No space left on device"):
                    m1.wait_writes()
                with pytest.raises(DscoreError, match="'big2' is not available"):
                    m1.prefetch("big2")
                m1.remove("big2")
                m1.swap_out("big2", torch.ones(100))  # space again
                assert torch.equal(m1.swap_in("big2"), torch.ones(100))
        assert list(mnt.iterdir()) == []
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_exit_cleanup_and_stale_folders(swap, tmp_path: Path, ops_cache: Path) -> None:  # type: ignore[no-untyped-def]
    """A process that exits without close() leaves nothing; a folder whose owner died is reported stale."""
    script = textwrap.dedent(
        f"""
        import os, torch
        from dscore_plugins.zero.nvme_swap import NVMeSwapManager
        m = NVMeSwapManager({str(tmp_path)!r}, run_id="exit")
        m.swap_out("w", torch.ones(100))
        assert (m.folder / "000000.swp").exists()
        print(os.getpid())
        """
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ops_cache), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "dscore-swap-exit").exists()
    dead_pid = int(res.stdout.strip())
    crashed = tmp_path / "dscore-swap-crashed" / "rank0"
    crashed.mkdir(parents=True)
    import socket

    (crashed / "owner.json").write_text(json.dumps({"pid": dead_pid, "host": socket.gethostname()}))
    with swap.NVMeSwapManager(tmp_path, run_id="alive") as live:
        assert swap.find_stale_swap_folders(tmp_path) == [crashed]
        assert live.folder not in swap.find_stale_swap_folders(tmp_path)
    assert swap.find_stale_swap_folders(tmp_path / "missing") == []
