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


class _TakesAll:
    """A registered transport that would take every call it is asked for."""

    name = "takes_all"

    def __init__(self) -> None:
        self.asked: list[str] = []

    def accepts(self, op: str, group: Any, tensors: Any) -> bool:
        self.asked.append(op)
        return True


def test_registered_transports_never_see_device_tensors() -> None:
    """Whatever a registered transport accepts, a non-CPU tensor stays on the backend (the core's rule),
    and an ineligible call (eligible False) never reaches the transports."""
    greedy = _TakesAll()
    meta, cpu = torch.empty(4, device="meta"), torch.empty(4)
    assert pick(None, True, [meta], op="all_reduce", transports=[greedy]) is None
    assert pick(None, True, [cpu, meta], op="all_gather", transports=[greedy]) is None
    assert pick(None, False, [cpu], op="all_gather", transports=[greedy]) is None
    assert greedy.asked == []
    assert pick(None, True, [cpu], op="reduce_scatter", transports=[greedy]) is greedy
    assert greedy.asked == ["reduce_scatter"]
    with pytest.raises(ValueError, match="unknown transport operation"):
        pick(None, True, [cpu], op="broadcast", transports=[greedy])


def test_transport_order_and_op_builder_gate() -> None:
    """Descending priority; a transport whose op builder is disabled is left out (the core still runs)."""
    from dscore.comm.transports import transport_specs
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    assert [s.name for s in transport_specs(Registry(create_plugin_manager()))] == ["shm", "p2p"]
    assert [s.name for s in transport_specs(Registry(create_plugin_manager(disable=["op_builder:shm_sync"])))] == ["p2p"]
    assert [s.name for s in transport_specs(Registry(create_plugin_manager(disable=["comm_transport:p2p"])))] == ["shm"]
    assert transport_specs(Registry(create_plugin_manager(disable=["comm"]))) == ()


_HOOK_CHECK = """
from dscore.comm.instrument import COLLECTIVES, instrumentable, wrap_collectives, wrappers

assert "all_reduce" in COLLECTIVES and "barrier" in COLLECTIVES


class Before:
    def all_reduce(self):
        return "before"

    def unrelated(self):
        return "left alone"


instrumentable(Before)
seen = []


def wrapper(name, method):
    def wrapped(self, *args, **kwargs):
        seen.append(type(self).__name__ + "." + name)
        return method(self, *args, **kwargs)

    return wrapped


wrap_collectives(wrapper)
wrap_collectives(wrapper)  # again: no second layer
assert wrappers()[-1] is wrapper


class After:
    def barrier(self):
        return "after"


instrumentable(After)
instrumentable(After)
assert Before().all_reduce() == "before" and Before().unrelated() == "left alone"
assert After().barrier() == "after"
assert seen == ["Before.all_reduce", "After.barrier"], seen
print("ok")
"""


def test_collective_wrappers_apply_to_every_instrumentable_class() -> None:
    """The hook point the comms logger attaches through: a wrapper reaches classes declared before and
    after it, once each (in a fresh interpreter: a registered wrapper stays for the process)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _HOOK_CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_comms_logger_attaches_through_the_hook_point() -> None:
    """Importing the comm plugin's logger wraps the facade's collectives (the core imports no plugin)."""
    import dscore.comm.comms_logger as thin
    from dscore_plugins.comm import comms_logger

    assert thin.get_comms_logger is comms_logger.get_comms_logger
    assert getattr(Comm.all_reduce, "__comms_logged__", False) is True
    assert comms_logger.LOGGED_OPS == frozenset(
        {"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
         "broadcast", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter", "all_reduce_coalesced",
         "all_gather_coalesced", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
         "monitored_barrier"}
    )
