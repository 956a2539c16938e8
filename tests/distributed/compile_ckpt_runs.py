"""Rank functions for tests/distributed/test_compile_features.py: dscore.checkpointing.checkpoint under
engine.compile() on 2 gloo ranks (issue 41 item 3)."""

from __future__ import annotations

from typing import Any

WIDTH, MICRO, STEPS = 16, 4, 3


class Recorder:
    """A dynamo backend that counts its graphs and hands them to ``inner`` (a registered backend name)."""

    def __init__(self, inner: str) -> None:
        self.inner, self.graphs = inner, 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        if self.inner == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


def _model(checkpointed: bool) -> Any:
    import torch

    from dscore import checkpointing as ck

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lins = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, device="cpu") for _ in range(2))
            self.drop = torch.nn.Dropout(0.5)

        def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.drop(self.lins[i](x)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(2):
                x = ck.checkpoint(self.block, i, x) if checkpointed else self.block(i, x)
            return x

    return Net()


def checkpoint_under_engine_compile(backend: str, stage: int) -> dict[str, Any]:
    """Plain vs checkpointed model, both engine.compile()d with ``backend``, same seeds: losses, weights, breaks."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dscore

    out: dict[str, Any] = {}
    for name in ("plain", "ckpt"):
        torch._dynamo.reset()
        counters.clear()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = dscore.initialize(model=_model(name == "ckpt"), config=config)
        rank = dist.get_rank()
        rec = Recorder(backend)
        engine.compile(backend=rec)
        g = torch.Generator().manual_seed(5 + rank)
        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        losses = []
        for _ in range(STEPS):
            x = torch.randn(MICRO, WIDTH, generator=g).to(engine.device)
            loss = (engine(x) ** 2).sum()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            weights = [p.detach().to("cpu").clone() for p in engine.module.parameters()]
        out[name] = {
            "losses": losses,
            "weights": weights,
            "breaks": sum(counters["graph_break"].values()),
            "graphs": rec.graphs,
        }
        engine.close()
    return out
