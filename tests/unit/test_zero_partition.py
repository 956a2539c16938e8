"""Single-process pieces of ZeRO: partition layout round trips, flat units, offload rules, registration."""

from __future__ import annotations

import pytest
import torch

from dscore.comm import Comm
from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.zero import GroupLayout, Segment, scatter_by_name, unscale_clip
from dscore.zero.partition import FlatUnit, unit_of
from dscore_plugins.zero.offload import offload_device


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
    unit = FlatUnit([lin.weight, lin.bias], Comm(None), dtype=torch.float32, device=torch.device("cpu"))
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
    norm, overflow = unscale_clip(scaled, Comm(None), divisor=8.0, clip=0.7, check_overflow=True)
    assert not overflow and torch.allclose(norm, want)
    for got, r in zip(scaled, ref):
        assert torch.allclose(got, r.grad, atol=1e-6)
    bad = [torch.tensor([float("inf"), 1.0])]
    assert unscale_clip(bad, Comm(None), divisor=1.0, clip=1.0, check_overflow=True) == (None, True)


def test_offload_device_reads_the_validated_block() -> None:
    from dscore_plugins.zero.config import ZeroConfig

    zc = ZeroConfig.model_validate({"stage": 2, "offload_optimizer": {"device": "CPU"}})
    assert offload_device(zc.offload_optimizer, "offload_optimizer") == "cpu"
    assert offload_device(zc.offload_param, "offload_param") == "none"
    nvme = ZeroConfig.model_validate({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}})
    assert offload_device(nvme.offload_param, "offload_param") == "nvme"


def test_zero_stages_1_to_3_are_registered_plugins() -> None:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import resolve

    registry = Registry(create_plugin_manager())
    for stage in (0, 1, 2, 3):
        spec = registry.zero_stage(stage)
        cls = resolve(spec.factory)
        assert cls.stage == stage and spec.name == f"stage{stage}" and spec.default


def test_zero_implementation_key_selects_by_name_and_checks_the_stage() -> None:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    registry = Registry(create_plugin_manager())
    assert registry.zero_stage(2, implementation="stage2").name == "stage2"
    assert registry.zero_stage(2, implementation="STAGE2").name == "stage2"  # names are case-insensitive
    with pytest.raises(ConfigError, match=r"implements ZeRO stage 3, but zero_optimization.stage is 2") as err:
        registry.zero_stage(2, implementation="stage3")
    assert err.value.path == "zero_optimization.implementation"
    with pytest.raises(ComponentNotFoundError, match=r"zero_optimization.implementation = 'stag2'.*Did you mean 'stage2'"):
        registry.zero_stage(2, implementation="stag2")


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


def test_two_default_implementations_of_one_stage_conflict_and_a_named_one_does_not() -> None:
    from types import SimpleNamespace

    from dscore import hookimpl
    from dscore.errors import PluginConflictError
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import ZeroStageSpec

    def plugin(name: str, *, default: bool) -> SimpleNamespace:
        @hookimpl
        def dscore_register_zero_stages() -> list[ZeroStageSpec]:
            return [ZeroStageSpec(name=name, stage=2, default=default, factory="dscore_plugins.zero.stage2:Stage2")]

        return SimpleNamespace(dscore_register_zero_stages=dscore_register_zero_stages)

    named = Registry(create_plugin_manager(extra_plugins=[("variant", plugin("my_stage2", default=False))]))
    assert named.zero_stage(2).name == "stage2"  # the built-in stays the default
    assert named.zero_stage(2, implementation="my_stage2").name == "my_stage2"

    clash = Registry(create_plugin_manager(extra_plugins=[("rival", plugin("rival_stage2", default=True))]))
    with pytest.raises(PluginConflictError, match="stage 2"):
        clash.zero_stage(2)
    assert clash.zero_stage(2, implementation="rival_stage2").name == "rival_stage2"  # naming one resolves it
