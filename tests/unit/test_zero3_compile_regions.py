"""ZeRO-3 under torch.compile (issue 41 item 2): which modules become compiled regions, and what a region's
compiled ``forward`` does to ``copy.deepcopy`` (dscore_plugins.zero.regions, dscore.runtime.compile)."""

from __future__ import annotations

import copy

import torch

from dscore.runtime.compile import compile_regions
from dscore_plugins.zero.regions import choose_regions


def _hooked(root: torch.nn.Module) -> list[torch.nn.Module]:
    # what stage 3 hooks: every module owning parameters of its own
    return [m for m in root.modules() if any(True for _ in m.parameters(recurse=False))]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attn(x))


class Model(torch.nn.Module):
    """A transformer's shape: an embedding, a list of blocks, a final norm, a head, and a parameter of the
    root itself (GPT's positional embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.zeros(4, device="cpu"))
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.act = torch.nn.GELU()  # no parameters: not a region
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(self.act(x)))


def test_blocks_and_remaining_parameter_owners_are_the_regions() -> None:
    model = Model()
    regions = choose_regions(model, _hooked(model))
    assert [name for name, _, _ in regions] == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    name_of = {m: n for n, m in model.named_modules()}
    # a block's region carries the hooks of every module inside it, in module order
    assert [name_of[m] for m in regions[1][2]] == ["blocks.0.attn", "blocks.0.norm"]
    # the root owns `pos` and has regions below: it stays eager (its own hook gathers `pos`)
    assert all(r is not model for _, r, _ in regions)


def test_sequential_entries_a_lone_module_and_a_shared_module() -> None:
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))
    assert [n for n, _, _ in choose_regions(seq, _hooked(seq))] == ["0", "2"]
    lone = torch.nn.Linear(2, 2)  # the root owns everything and nothing below it does: the root is the region
    assert [(n, r) for n, r, _ in choose_regions(lone, _hooked(lone))] == [("", lone)]

    shared = torch.nn.Linear(2, 2)
    two = torch.nn.Module()
    two.a = torch.nn.Sequential(shared)
    two.b = torch.nn.Sequential(shared)  # the same module under two parents is one region
    assert [n for n, _, _ in choose_regions(two, _hooked(two))] == ["a.0"]


def test_region_forward_is_compiled_alone_and_a_deep_copy_runs_plain() -> None:
    model = Model()
    ids = torch.tensor([[1, 2, 3]], device="cpu")
    expected = model(ids)
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(gm.code)
        return gm.forward

    regions = [(n, r) for n, r, _ in choose_regions(model, _hooked(model))]
    calls: list[str] = []
    for name, region in regions:  # hooks on a region run outside its compiled forward
        region.register_forward_pre_hook(lambda m, a, name=name: calls.append(name))
    torch._dynamo.reset()
    compile_regions(regions, lambda fn: torch.compile(fn, backend=backend, fullgraph=True))
    assert torch.equal(model(ids), expected)
    assert len(graphs) == len(regions)  # one graph each: the two blocks do not share a code object's cache
    assert calls == ["embed", "blocks.0", "blocks.1", "norm", "head"]

    clone = copy.deepcopy(model)
    graphs.clear()
    assert torch.equal(clone(ids), expected)
    assert graphs == []  # the copy runs its plain forward, not the original's compiled code
    assert all("forward" not in vars(m) or not hasattr(vars(m)["forward"], "compiled") for m in clone.modules())
