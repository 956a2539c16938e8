"""Single-process pieces of ZeRO: partition layout round trips, flat units, offload rules, registration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dscore.errors import ConfigError
from dscore.zero._comm import Collectives
from dscore.zero.partition import FlatUnit, unit_of
from dscore_plugins.zero._common import (
    GroupLayout,
    Segment,
    check_client_optimizer_for_offload,
    offload_device,
    scatter_by_name,
    unscale_clip,
)


class _FakeColl(Collectives):
    """World ``world`` seen from one rank, for layout arithmetic only (no collectives run)."""

    def __init__(self, rank: int, world: int) -> None:
        self.group = None
        self.comm = None
        self.rank, self.world = rank, world
        self.gloo_fast = False


def _layout(shapes: list[tuple[int, ...]], world: int) -> GroupLayout:
    numels = [int(torch.Size(s).numel()) for s in shapes]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    chunk = -(-sum(numels) // world)
    seg = Segment(part_offset=0, chunk=chunk, names=[f"p{i}" for i in range(len(shapes))], offsets=offsets,
                  numels=numels, shapes=[torch.Size(s) for s in shapes])
    return GroupLayout(segments=[seg], numel=chunk)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scatter_by_name_partitions_cover_every_element_once(world: int) -> None:
    shapes = [(3, 5), (7,), (2, 2, 3)]  # 34 elements: uneven for 3 and 4
    values = {f"p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    layout = _layout(shapes, world)
    parts = []
    for r in range(world):
        out = torch.full((layout.numel,), float("nan"))
        scatter_by_name(values, layout, r, out)
        parts.append(out)
    flat = torch.cat(parts)
    expect = torch.cat([v.reshape(-1) for v in values.values()])
    assert torch.equal(flat[: expect.numel()], expect)
    assert torch.equal(flat[expect.numel() :], torch.zeros(flat.numel() - expect.numel()))  # padding is zero


def test_scatter_by_name_names_a_missing_parameter() -> None:
    with pytest.raises(KeyError, match="p1"):
        scatter_by_name({"p0": torch.zeros(3, 5)}, _layout([(3, 5), (7,)], 2), 0, torch.zeros(11))


def test_flat_unit_views_release_and_regather_single_rank() -> None:
    lin = torch.nn.Linear(4, 3)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    unit = FlatUnit([lin.weight, lin.bias], Collectives(), dtype=torch.float32, device=torch.device("cpu"))
    unit.load_full([w, b])
    assert unit_of(lin.weight) is unit and unit.numel == 15 and unit.chunk == 15
    assert lin.weight.data_ptr() == unit.full.data_ptr()
    out = lin(torch.ones(2, 4))
    unit.release()
    assert unit.full.untyped_storage().nbytes() == 0 and not unit.gathered
    unit.gather()
    out.sum().backward()  # autograd-saved views read the re-gathered storage
    assert torch.equal(lin.weight.detach(), w) and torch.equal(lin.bias.detach(), b)
    assert torch.allclose(lin.weight.grad, torch.ones(3, 4) * 2)


def test_unscale_clip_matches_clip_grad_norm() -> None:
    g = [torch.randn(10) * 3, torch.randn(7)]
    ref = [t.clone().requires_grad_() for t in g]
    for r, t in zip(ref, g):
        r.grad = t.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 0.7)
    scaled = [t * 8.0 for t in g]  # loss scale 4 x world 2 folded into the divisor
    norm, overflow = unscale_clip(scaled, Collectives(), divisor=8.0, clip=0.7, check_overflow=True)
    assert not overflow and torch.allclose(norm, want)
    for got, r in zip(scaled, ref):
        assert torch.allclose(got, r.grad, atol=1e-6)
    bad = [torch.tensor([float("inf"), 1.0])]
    assert unscale_clip(bad, Collectives(), divisor=1.0, clip=1.0, check_overflow=True) == (None, True)


def _ctx(opt: torch.optim.Optimizer | None, force: bool | None = True) -> SimpleNamespace:
    return SimpleNamespace(client_optimizer=opt, config=SimpleNamespace(zero_force_ds_cpu_optimizer=force))


def test_client_optimizer_with_cpu_offload_names_the_opt_out_key() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match='"zero_force_ds_cpu_optimizer": false'):
        check_client_optimizer_for_offload(_ctx(opt), offload=True)
    check_client_optimizer_for_offload(_ctx(opt, force=False), offload=True)  # opted out
    check_client_optimizer_for_offload(_ctx(opt), offload=False)  # no offload: anything goes

    class DscoreCPUAdam(torch.optim.SGD):
        pass

    check_client_optimizer_for_offload(_ctx(DscoreCPUAdam([torch.nn.Parameter(torch.zeros(2))], lr=0.1)), offload=True)


def test_offload_device_parsing_and_nvme_error() -> None:
    zc = SimpleNamespace(offload_optimizer=SimpleNamespace(device="cpu", pin_memory=True), offload_param=None)
    assert offload_device(zc, "offload_optimizer") == "cpu"
    assert offload_device(zc, "offload_param") == "none"
    with pytest.raises(ConfigError, match="nvme"):
        offload_device(SimpleNamespace(offload_param=SimpleNamespace(device="nvme")), "offload_param")


def test_zero_stages_1_to_3_are_registered_plugins() -> None:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import resolve

    registry = Registry(create_plugin_manager())
    for stage in (1, 2, 3):
        spec = registry.zero_stage(stage)
        cls = resolve(spec.factory)
        assert cls.stage == stage


def test_zero_init_without_process_group_says_what_to_do() -> None:
    import dscore

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_distributed"):
        with dscore.zero.Init():
            torch.nn.Linear(2, 2)
    with dscore.zero.Init(enabled=False):
        lin = torch.nn.Linear(2, 2)
    assert unit_of(lin.weight) is None
