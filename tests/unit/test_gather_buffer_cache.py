"""GatherBufferCache: released gather buffers are reused by the next gather of the same size, within the
high-water mark of what was gathered at once, and views of a unit (parameters, autograd-saved views)
see the re-gathered values through the same storage object."""

from __future__ import annotations

import pytest
import torch

from dscore.comm import Comm
from dscore.zero.buffer_cache import GatherBufferCache
from dscore.zero.partition import FlatUnit


def _storage(nbytes: int) -> torch.UntypedStorage:
    t = torch.zeros(nbytes // 4)
    s = t.untyped_storage()
    s.resize_(0)
    return s


def test_a_released_buffer_is_reused_by_the_next_fill_of_its_size() -> None:
    cache = GatherBufferCache()
    a, b = _storage(4096), _storage(4096)
    cache.fill(a, 4096)
    ptr = a.data_ptr()
    assert (cache.misses, cache.live_bytes, cache.high_water_bytes) == (1, 4096, 4096)
    cache.drain(a)
    assert a.nbytes() == 0 and cache.cached_bytes == 4096 and cache.live_bytes == 0
    cache.fill(b, 4096)  # another storage of the same size gets the same memory
    assert b.data_ptr() == ptr and b.nbytes() == 4096
    assert (cache.hits, cache.cached_bytes) == (1, 0)
    c = _storage(8192)
    cache.fill(c, 8192)  # no block of that size: a fresh allocation
    assert cache.misses == 2 and cache.high_water_bytes == 4096 + 8192


def test_cached_plus_live_never_exceeds_the_high_water_mark() -> None:
    cache = GatherBufferCache()
    small = [_storage(1024) for _ in range(3)]
    for s in small:
        cache.fill(s, 1024)
    for s in small:
        cache.drain(s)
    assert cache.cached_bytes == 3 * 1024 == cache.high_water_bytes
    big = _storage(2048)
    cache.fill(big, 2048)  # a miss: live 2048 + cached 3072 is above the mark until drains free blocks
    assert cache.high_water_bytes == 3 * 1024
    cache.drain(big)  # keeping it would go above the mark: freed
    assert big.nbytes() == 0
    assert cache.cached_bytes == 3 * 1024
    assert cache.live_bytes + cache.cached_bytes <= cache.high_water_bytes
    assert cache.empty() == 3 * 1024
    assert cache.cached_bytes == 0 and cache.high_water_bytes == cache.live_bytes == 0


def test_empty_frees_everything_kept_and_restarts_the_mark() -> None:
    cache = GatherBufferCache()
    s = _storage(4096)
    cache.fill(s, 4096)
    cache.drain(s)
    assert cache.empty() == 4096
    t = _storage(4096)
    cache.fill(t, 4096)
    assert cache.misses == 2 and cache.hits == 0


def test_fill_refuses_a_storage_that_still_holds_memory() -> None:
    cache = GatherBufferCache()
    s = torch.zeros(4).untyped_storage()
    with pytest.raises(ValueError, match="already holds 16 bytes"):
        cache.fill(s, 16)


def test_a_unit_regathered_from_the_cache_keeps_its_views_and_values() -> None:
    lin = torch.nn.Linear(8, 4)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    unit = FlatUnit(list(lin.parameters()), Comm(None), dtype=torch.float32, device=torch.device("cpu"))
    unit.load_full([w0, b0])
    unit.buffer_cache = GatherBufferCache()
    x = torch.randn(3, 8)
    saved_view = lin.weight.t()  # a view like the ones autograd saves
    unit.release()
    assert unit.full.untyped_storage().nbytes() == 0
    unit.gather()  # a miss: nothing was filled through the cache yet
    ptr = unit.full.data_ptr()
    assert torch.equal(lin.weight, w0) and torch.equal(saved_view, w0.t())
    unit.release()
    unit.gather()  # a hit: the same memory comes back
    assert unit.full.data_ptr() == ptr and unit.buffer_cache.hits == 1
    assert torch.equal(lin(x), x @ w0.t() + b0)
    assert torch.equal(saved_view, w0.t())
