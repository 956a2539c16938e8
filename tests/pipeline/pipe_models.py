"""Tiny models, data and per-rank training functions shared by the pipeline tests and the benchmark.

The pipeline model is ``[tied embedding, Block, Block, (function), tied head]``; the plain reference is
the same layers in one process (built with the same per-layer seeds), the head reusing the embedding
weight. Every function here is module-level so ``run_distributed`` can pickle it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, MICRO = 11, 8, 4, 2
BASE_SEED = 1234


class Block(torch.nn.Module):
    """``tanh(Linear(x))`` with optional dropout (dropout makes activation checkpointing's RNG replay matter)."""

    def __init__(self, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.fc(x)))


def head_forward(embedding: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: logits against the embedding matrix."""
    return x @ embedding.weight.t()


def scale_half(x: torch.Tensor) -> torch.Tensor:
    """A parameterless function layer."""
    return x * 0.5


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class _InfGrad(torch.autograd.Function):
    """Identity in ``x``; ``w``'s gradient is infinite when ``poison`` (``x``'s stays finite)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, poison: bool) -> torch.Tensor:
        ctx.poison = poison
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        gw = torch.full((1,), float("inf") if ctx.poison else 0.0, dtype=grad.dtype, device=grad.device)
        return grad, gw, None


class Poison(torch.nn.Module):
    """Identity with one parameter whose gradient is infinite during training step ``step`` (micro-batches
    ``gas * step`` to ``gas * (step + 1) - 1``): only this layer's stage sees a non-finite gradient."""

    def __init__(self, step: int, gas: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.step, self.gas, self.calls = step, gas, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return x
        poison = self.calls // self.gas == self.step
        self.calls += 1
        return _InfGrad.apply(x, self.w, poison)


def layer_specs(blocks: int = 2, dropout: float = 0.0, poison: tuple[int, int] | None = None) -> list[Any]:
    """The pipeline layers: tied embedding, (a :class:`Poison` layer,) ``blocks`` Blocks, a function, the tied head."""
    from dscore.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN),
        *([LayerSpec(Poison, *poison)] if poison is not None else []),
        *[LayerSpec(Block, HIDDEN, dropout) for _ in range(blocks)],
        scale_half,
        TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN, forward_fn=head_forward),
    ]


class PlainNet(torch.nn.Module):
    """The reference: the same layers in one module, built with the pipeline's per-layer seeds."""

    def __init__(self, blocks: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED + 0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        mods = []
        for i in range(blocks):
            torch.manual_seed(BASE_SEED + 1 + i)
            mods.append(Block(HIDDEN, dropout))
        self.blocks = torch.nn.ModuleList(mods)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return head_forward(self.embed, scale_half(x))

    def pipeline_layers(self) -> list[torch.nn.Module | None]:
        """The module at each pipeline position (for :func:`dscore.pipe.load_into_layers`)."""
        return [self.embed, *self.blocks, None, self.embed]


def micro_batch(step: int, dp_rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(tokens, labels)`` for a step, replica and micro-batch index."""
    g = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + mb)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return tokens, labels


def config(gas: int, *, zero_stage: int = 0, clip: float = 0.0, bf16: bool = False, lr: float = 0.1) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": clip,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def state_by_layer(pipe: Any) -> dict[int, dict[str, list[Any]]]:
    """``{layer index: state}`` of the layers this stage holds, as nested lists (tensors do not survive
    the trip through the result queue once the rank exits)."""
    out = {}
    for idx in pipe.layer_range():
        module = pipe.layer_module(idx)
        if module is not None:
            out[idx] = {k: v.detach().float().tolist() for k, v in module.state_dict().items()}
    return out


def train_pipeline(
    num_stages: int,
    steps: int,
    gas: int,
    *,
    zero_stage: int = 0,
    clip: float = 0.0,
    bf16: bool = False,
    checkpoint_interval: int = 0,
    dropout: float = 0.0,
    partition: str = "uniform",
    save_dir: str | None = None,
    poison_step: int | None = None,
    compiled: bool = False,
) -> dict[str, Any]:
    """Per rank: build the pipeline, train ``steps`` batches, optionally save, return losses and states.

    ``compiled``: ``engine.compile()`` first with a backend that counts the graphs it gets (``graphs``; and
    ``graph_breaks``, dynamo's count) and runs them as traced.

    ``checkpoints`` in the result counts the calls of :func:`dscore.checkpointing.checkpoint` made by the
    stage's forward (0 without ``checkpoint_interval``)."""
    import torch.distributed as dist

    import dscore
    from dscore import checkpointing
    from dscore.pipe import PipelineModule

    calls = [0]

    def counting_checkpoint(fn: Any, *args: Any) -> Any:
        calls[0] += 1
        return checkpointing.checkpoint(fn, *args)

    torch.manual_seed(7)  # dropout masks: the same stream on every layout is not required, only determinism
    pipe = PipelineModule(
        layers=layer_specs(dropout=dropout, poison=None if poison_step is None else (poison_step, gas)),
        num_stages=num_stages,
        loss_fn=loss_fn,
        partition_method=partition,
        seed_layers=True,
        base_seed=BASE_SEED,
        activation_checkpoint_interval=checkpoint_interval,
        activation_checkpoint_func=counting_checkpoint,
    )
    engine, _, _, _ = dscore.initialize(
        model=pipe, config=config(gas, zero_stage=zero_stage, clip=clip, bf16=bf16)
    )
    graphs = [0]
    if compiled:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()

        def recorder(gm: Any, example_inputs: Any) -> Any:
            graphs[0] += 1
            return gm.forward

        engine.compile(backend=recorder)
    dp = pipe.grid.data_parallel_id
    losses = []
    norms = []
    per_step = []
    for step in range(steps):
        data = iter([micro_batch(step, dp, mb) for mb in range(gas)])
        losses.append(float(engine.train_batch(data)))
        norms.append(engine.get_global_grad_norm())
        per_step.append(state_by_layer(pipe))
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t1")
    result = {
        "rank": dist.get_rank(),
        "stage": pipe.stage_id,
        "dp": dp,
        "losses": losses,
        "norms": norms,
        "layers": state_by_layer(pipe) if dp == 0 else {},
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "checkpoints": calls[0],
        "per_step": per_step,
        "skipped_steps": engine.skipped_steps,
        "is_compiled": engine.is_compiled,
        "graphs": graphs[0],
    }
    if compiled:
        result["graph_breaks"] = sum(counters["graph_break"].values())
    engine.close()
    return result


def train_many(num_stages: int, steps: int, gas: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: :func:`train_pipeline` once per keyword set in ``runs`` (``{"random_pairs": True}``:
    :func:`train_random_pairs`), one process start for all."""
    return [
        train_random_pairs(num_stages, steps) if kwargs.get("random_pairs") else train_pipeline(num_stages, steps, gas, **kwargs)
        for kwargs in runs
    ]


class Scale(torch.nn.Module):
    """``x * w`` with ``w = 1`` at the start, so the untrained model is the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class RandomPairs(torch.utils.data.Dataset):
    """Sample ``i`` is ``(r, r)`` for a fresh ``r = random.random()`` (DeepSpeed #3131's dataset): inputs equal
    labels only when the stages read the same draw."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import random

        r = random.random()
        return torch.tensor([r]), torch.tensor([r])


def mse(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return ((out - labels) ** 2).mean()


def train_random_pairs(num_stages: int, steps: int) -> dict[str, Any]:
    """Per rank: a ``num_stages`` identity pipeline trained on :class:`RandomPairs` through the engine's own
    loader (every process seeds ``random`` differently); returns the losses (all 0 when the last stage's
    labels belong to the first stage's inputs)."""
    import random

    import torch.distributed as dist

    import dscore
    from dscore.pipe import PipelineModule

    random.seed(1000 + dist.get_rank())
    pipe = PipelineModule(layers=[Scale() for _ in range(num_stages)], num_stages=num_stages, loss_fn=mse)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = dscore.initialize(model=pipe, config=config, training_data=RandomPairs())
    losses = [float(engine.train_batch()) for _ in range(steps)]
    engine.close()
    return {"losses": losses}


def train_reference(steps: int, gas: int, dp: int, *, clip: float = 0.0, lr: float = 0.1) -> dict[str, Any]:
    """Single-process plain-torch reference of :func:`train_pipeline` (fp32)."""
    model = PlainNet()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        per_replica = []
        total = 0.0
        for d in range(dp):
            rep = 0.0
            for mb in range(gas):
                tokens, labels = micro_batch(step, d, mb)
                loss = loss_fn(model(tokens), labels)
                (loss / (gas * dp)).backward()
                rep += float(loss.detach()) / gas
            per_replica.append(rep)
            total += rep / dp
        norm = None
        if clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        losses.append(total)
        norms.append(norm)
    layers = {i: {k: v.detach().clone() for k, v in m.state_dict().items()} for i, m in enumerate(model.pipeline_layers()) if m is not None}
    return {"losses": losses, "norms": norms, "layers": layers, "model": model, "optimizer": opt}


def reference_step(model: PlainNet, opt: torch.optim.Optimizer, step: int, gas: int) -> tuple[float, dict[int, dict[str, torch.Tensor]]]:
    """One more fp32 step of a reference (one replica, no clipping): ``(loss, layers)``."""
    opt.zero_grad()
    total = 0.0
    for mb in range(gas):
        tokens, labels = micro_batch(step, 0, mb)
        loss = loss_fn(model(tokens), labels)
        (loss / gas).backward()
        total += float(loss.detach()) / gas
    opt.step()
    layers = {i: {k: v.detach().clone() for k, v in m.state_dict().items()} for i, m in enumerate(model.pipeline_layers()) if m is not None}
    return total, layers


def load_checkpoint_at(num_stages: int, save_dir: str, gas: int) -> dict[str, Any]:
    """Per rank: build a pipeline at ``num_stages``, load ``save_dir`` and train one more batch."""
    import dscore
    from dscore.pipe import PipelineModule

    pipe = PipelineModule(
        layers=layer_specs(), num_stages=num_stages, loss_fn=loss_fn, partition_method="uniform",
        seed_layers=True, base_seed=BASE_SEED + 99,  # different init: the load must overwrite it
    )
    engine, _, _, _ = dscore.initialize(model=pipe, config=config(gas))
    engine.load_checkpoint(save_dir)
    loaded = state_by_layer(pipe)
    dp = pipe.grid.data_parallel_id
    data = iter([micro_batch(3, dp, mb) for mb in range(gas)])
    loss = float(engine.train_batch(data))
    result = {"loaded": loaded if dp == 0 else {}, "after": state_by_layer(pipe) if dp == 0 else {}, "loss": loss,
              "global_steps": engine.global_steps}
    engine.close()
    return result


def rank_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def always(model: Any, config: Any) -> bool:
    """An engine predicate accepting every model (engine-selection tests)."""
    return True


def not_a_bool(model: Any, config: Any) -> Any:
    """A broken engine predicate (engine-selection tests)."""
    return "yes"


def never_built(ctx: Any) -> Any:
    """An engine factory the selection tests never reach."""
    raise AssertionError("the engine factory should not be called")
