"""dscore.checkpointing.checkpoint under torch.compile (issue 41 item 3): traced without a graph break, and the
recompute draws the forward's dropout mask on every backend (``eager`` included, where torch's own
non-reentrant checkpoint does not replay the RNG under compile)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from dscore import checkpointing as ck

WIDTH = 16


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    ck._reset_for_tests()
    torch._dynamo.reset()
    counters.clear()
    yield
    ck._reset_for_tests()
    torch._dynamo.reset()


class Recorder:
    """A dynamo backend counting the graphs it gets, then handing them to ``inner`` (a registered backend)."""

    def __init__(self, inner: str) -> None:
        self.inner, self.graphs = inner, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        if self.inner == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


class Net(torch.nn.Module):
    """Linear -> Dropout(0.5) -> Tanh, twice; ``checkpointed`` wraps each block in dscore's checkpoint."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, device="cpu") for _ in range(2))
        self.drop = torch.nn.Dropout(0.5)
        self.checkpointed = checkpointed

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.drop(self.lins[i](x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            x = ck.checkpoint(self.block, i, x) if self.checkpointed else self.block(i, x)
        return (x * x).sum()


def _step(checkpointed: bool, backend: str) -> dict[str, Any]:
    torch._dynamo.reset()
    counters.clear()
    net = Net(checkpointed)
    rec = Recorder(backend)
    compiled = torch.compile(net, backend=rec)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu", requires_grad=True)
    torch.manual_seed(123)
    losses = []
    for _ in range(2):  # the second call reuses the graph and draws new masks
        loss = compiled(x)
        loss.backward()
        losses.append(loss.detach())
    return {
        "losses": losses,
        "grads": [x.grad, *(p.grad for p in net.parameters())],
        "rng_after": torch.rand(4, device="cpu"),  # the recompute gave the caller its RNG back
        "breaks": sum(counters["graph_break"].values()),
        "graphs": rec.graphs,
    }


def _assert_same(plain: dict[str, Any], ckpt: dict[str, Any]) -> None:
    assert ckpt["breaks"] == 0
    assert ckpt["graphs"] == 1  # one graph holds both checkpointed blocks
    assert not torch.equal(ckpt["losses"][0], ckpt["losses"][1])  # dropout drew a fresh mask per call
    for a, b in zip(plain["losses"], ckpt["losses"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    for a, b in zip(plain["grads"], ckpt["grads"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert torch.equal(plain["rng_after"], ckpt["rng_after"])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpoint_is_traced_and_replays_dropout(backend: str) -> None:
    """Checkpointed vs plain under the same seed: equal losses, input and weight gradients, equal RNG state after,
    0 graph breaks and one recorded graph."""
    _assert_same(_step(False, backend), _step(True, backend))


@pytest.mark.slow
def test_checkpoint_is_traced_and_replays_dropout_inductor() -> None:
    _assert_same(_step(False, "inductor"), _step(True, "inductor"))


def test_cpu_checkpointing_under_compile_runs_eagerly_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Host placement of saved inputs cannot be compiled: the checkpoint runs eagerly (a graph break, said once in
    a warning naming the key) and its gradients still equal the plain block's."""
    plain = _step(False, "eager")
    ck.configure(checkpoint_in_cpu=True)
    with caplog.at_level(logging.WARNING, logger="dscore.checkpointing"):
        ckpt = _step(True, "eager")
    assert ckpt["breaks"] >= 1
    assert "activation_checkpointing.cpu_checkpointing" in caplog.text
    for a, b in zip(plain["grads"], ckpt["grads"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_list_output_comes_back_as_a_tuple_under_compile() -> None:
    """The eager path returns a tuple for a list-returning function; the compiled one does too."""

    def pair(x: torch.Tensor) -> list[torch.Tensor]:
        return [x * 2, x + 1]

    def f(x: torch.Tensor) -> Any:
        out = ck.checkpoint(pair, x)
        return type(out) is tuple, out[0] + out[1]

    x = torch.randn(3, device="cpu", requires_grad=True)
    is_tuple, y = torch.compile(f, backend="eager", fullgraph=True)(x)
    assert is_tuple
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
