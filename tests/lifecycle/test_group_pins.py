"""torch modules imported while the default group exists capture it as a default argument
(``torch.distributed.nn.functional``: ``group=group.WORLD``), which keeps a destroyed group — and its gloo
worker threads — alive into interpreter finalization, where those threads abort the process.
:func:`dscore.comm.init.release_torch_group_pins` rebinds such defaults to ``None``; engines call it, so a
destroyed group is freed (and its threads joined) at once."""

from __future__ import annotations

import sys
import types

import pytest

from dscore.comm.init import release_torch_group_pins
from dscore.testing import run_distributed


def test_release_rebinds_only_the_given_group_in_torch_distributed_modules() -> None:
    group, other = object(), object()

    def free(a, g=group, h=other, *, k=group):  # noqa: ANN001, ANN202 - shapes of torch's functions
        return a, g, h, k

    class Scaler:
        def __init__(self, process_group=group):  # noqa: ANN001
            self.process_group = process_group

        @staticmethod
        def helper(g=group):  # noqa: ANN001, ANN205
            return g

    outside = types.FunctionType(free.__code__, {}, "outside", free.__defaults__)
    outside.__kwdefaults__ = dict(free.__kwdefaults__ or {})
    name = "torch.distributed._dscore_pin_probe"
    module = types.ModuleType(name)
    free.__module__ = Scaler.__module__ = name
    module.free, module.Scaler = free, Scaler
    elsewhere = types.ModuleType("dscore_pin_probe_elsewhere")
    elsewhere.outside = outside
    sys.modules[name] = module
    sys.modules[elsewhere.__name__] = elsewhere
    try:
        assert release_torch_group_pins(group) == 4
        assert free.__defaults__ == (None, other) and free.__kwdefaults__ == {"k": None}
        assert Scaler.__init__.__defaults__ == (None,) and Scaler.helper() is None
        assert outside.__defaults__ == (group, other), "only torch.distributed modules are touched"
        assert release_torch_group_pins(group) == 0  # idempotent
    finally:
        del sys.modules[name], sys.modules[elsewhere.__name__]


def test_release_without_a_default_group_does_nothing() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    assert release_torch_group_pins() == 0


def _pinned_then_released():
    import importlib
    import weakref

    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnnf

    import dscore
    from dscore.comm.init import PROCESS_GROUP_OWNER

    def pin() -> bool:
        # imported (again) while the group exists: torch captures it, as torch._dynamo's import does
        importlib.reload(dnnf)
        return dnnf.all_reduce.__defaults__[-1] is dist.group.WORLD

    def next_rendezvous() -> None:
        # called before a destroy: the next group meets on a new port, so that no rank reaches the old
        # store of a rank that has not destroyed its group yet
        import os
        import socket

        box = [None]
        if dist.get_rank() == 0:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                box[0] = sock.getsockname()[1]
        dist.broadcast_object_list(box, src=0)
        os.environ["MASTER_PORT"] = str(box[0])

    def build():
        model = torch.nn.Linear(2, 1)
        return dscore.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD"}})

    # plain torch: the pin keeps a destroyed group alive; releasing it frees the group
    dist.init_process_group("gloo")
    pinned = pin()
    group = weakref.ref(dist.group.WORLD)
    next_rendezvous()
    dist.destroy_process_group()
    alive_after_plain_destroy = group() is not None
    released = release_torch_group_pins(group())
    freed = group() is None

    # the user's group and a dscore engine: the engine released the pin, so the user's destroy frees it
    dist.init_process_group("gloo")
    pin()
    engine, *_ = build()
    group = weakref.ref(dist.group.WORLD)
    next_rendezvous()
    dist.destroy_process_group()
    freed_user = group() is None
    del engine

    # dscore's own group, pinned after the engine was built: dscore's exit hook releases, then destroys
    dscore.init_distributed()
    engine, *_ = build()
    pin()
    group = weakref.ref(dist.group.WORLD)
    PROCESS_GROUP_OWNER.destroy_at_exit()
    freed_own = group() is None and not dist.is_initialized()
    return pinned, alive_after_plain_destroy, released >= 10, freed, freed_user, freed_own


@pytest.mark.slow
def test_a_pinned_group_outlives_destroy_until_released() -> None:
    out = run_distributed(_pinned_then_released, 2, init_process_group=False, timeout=180)
    assert out == [(True, True, True, True, True, True)] * 2
