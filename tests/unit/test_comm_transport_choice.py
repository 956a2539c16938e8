"""Which transport a collective takes (issue 28, defect 4): the gloo fast paths (point-to-point, shared
memory) are chosen by the tensors' device, not only by the backend's name. A non-CPU tensor on a gloo
group takes the backend's own collective; it never goes through gloo ``isend``/``irecv`` (torch has none
on GPUs) or host shared memory. A ``meta`` tensor stands for a device tensor (no GPU here); the process
group calls are replaced by recorders, so no process group is needed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dscore.comm import Comm
from dscore.comm.transports import pick


def test_pick_refuses_non_cpu_tensors() -> None:
    meta = torch.empty(4, device="meta")
    cpu = torch.empty(4, device="cpu")
    assert pick(None, True, [meta]) is None
    assert pick(None, True, [cpu, meta]) is None  # one device tensor is enough
    assert pick(None, False, [cpu]) is None  # not gloo (or DSCORE_GLOO_NATIVE=1)
    assert Comm(None, backend="gloo").gloo_fast(None, meta) is False


@pytest.fixture()
def fake_gloo_group() -> Iterator[list[str]]:
    """A 2-rank gloo 'group' whose collectives record their names instead of running (undone before the
    suite's own clean-up looks for a process group)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _fake(monkeypatch)


def _fake(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def record(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> None:
            calls.append(name)

        return fn

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a device tensor went through gloo point-to-point or shared memory")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, record(name))
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, record(name))
    monkeypatch.setattr(dist, "isend", forbidden)
    monkeypatch.setattr(dist, "irecv", forbidden)
    import dscore_plugins.comm.shm.bootstrap as shm

    monkeypatch.setattr(shm, "channel_for", forbidden)
    return calls


def test_device_tensors_take_the_backends_collectives(fake_gloo_group: list[str]) -> None:
    comm = Comm(None, backend="gloo")
    x = torch.empty(8, device="meta")
    comm.all_reduce(x)
    comm.all_reduce(x, op="avg")
    comm.all_gather_into_tensor(torch.empty(16, device="meta"), x)
    comm.all_gather([torch.empty(8, device="meta") for _ in range(2)], x)
    comm.reduce_scatter_tensor(torch.empty(4, device="meta"), x)
    comm.reduce_scatter(torch.empty(4, device="meta"), [torch.empty(4, device="meta") for _ in range(2)])
    assert len(fake_gloo_group) == 6, fake_gloo_group
    assert fake_gloo_group[0] == "all_reduce"
