"""The ``shm_sync`` op (csrc/comm/shm_sync.cpp), compiled with ninja: release/acquire words, descriptors,
and futex wait/wake whose return codes are checked (issue 27, input 4)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dscore.ops import get_op_builder


@pytest.fixture(scope="module")
def sync():  # type: ignore[no-untyped-def]
    return get_op_builder("shm_sync").load()


def test_words_and_descriptors(sync) -> None:  # type: ignore[no-untyped-def]
    words = torch.zeros(8, dtype=torch.int64, device="cpu")
    base = words.data_ptr()
    sync.store_release(base, 5)
    assert sync.load_acquire(base) == 5
    sync.publish_descriptor(base + 8, 7, [1, 2, 3])
    assert words[1:5].tolist() == [7, 1, 2, 3]
    assert sync.read_descriptor(base + 8, 7, 4) == [7, 1, 2, 3]
    assert sync.read_descriptor(base + 8, 8, 4) == []  # another exchange's number: not this one's yet
    with pytest.raises(ValueError, match="aligned 64-bit word"):
        sync.load_acquire(base + 4)


def test_futex_return_codes(sync) -> None:  # type: ignore[no-untyped-def]
    words = torch.zeros(2, dtype=torch.int64, device="cpu")
    addr = words.data_ptr()
    assert sync.futex_wait(addr, 1, 5.0) == 1  # the word is not 1: EAGAIN at once, not a 5 s sleep
    t0 = time.monotonic()
    assert sync.futex_wait(addr, 0, 0.05) == 2  # ETIMEDOUT: the timeout is honoured
    assert time.monotonic() - t0 < 5
    assert sync.futex_wake(addr, 1) == 0
    with pytest.raises(ValueError):
        sync.futex_wait(addr + 2, 0, 0.01)  # misaligned: refused before the system call


def test_store_release_and_wake_wakes_a_waiter(sync) -> None:  # type: ignore[no-untyped-def]
    words = torch.zeros(1, dtype=torch.int64, device="cpu")
    addr = words.data_ptr()
    seen: list[int] = []

    def waiter() -> None:
        while sync.load_acquire(addr) == 0:
            sync.futex_wait(addr, 0, 30.0)  # the GIL is released while it sleeps
        seen.append(int(sync.load_acquire(addr)))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    sync.store_release_and_wake(addr, 3)
    th.join(60)
    assert seen == [3]
