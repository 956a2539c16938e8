"""Rank functions for tests/distributed/test_engine_compile.py (importable by the spawned ranks)."""

from __future__ import annotations

from typing import Any

IN, HID, OUT, MICRO, STEPS = 8, 16, 4, 3, 5


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    # only torch.nn classes: nn.Module.compile() of this captures no graph in torch 2.13 (the trap)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID), torch.nn.GELU(), torch.nn.Linear(HID, OUT)
    )


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage},
    }


class Recorder:
    """A dynamo backend that counts the graphs it is given and runs them as captured (eager)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return gm.forward


def _train(engine: Any, rank: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(2 * MICRO, IN, generator=g)[rank * MICRO : (rank + 1) * MICRO].to(engine.device)
        y = torch.randn(2 * MICRO, OUT, generator=g)[rank * MICRO : (rank + 1) * MICRO].to(engine.device)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def engine_compile_stages(stages: list[int]) -> dict[str, Any]:
    """Per stage: eager losses, engine.compile(backend=Recorder, fullgraph) losses, graphs, breaks, no-op check."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dscore

    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, Any] = {}
    for stage in stages:
        eager, *_ = dscore.initialize(model=_model(), config=_config(stage))
        rank = dist.get_rank()
        eager_losses = _train(eager, rank)
        eager.close()

        torch._dynamo.reset()
        counters.clear()
        engine, *_ = dscore.initialize(model=_model(), config=_config(stage))
        before = engine.is_compiled
        rec = Recorder()
        # fullgraph at every stage: at ZeRO-3 each Linear is a region, its hooks outside the compiled forward
        engine.compile(backend=rec, compile_kwargs={"fullgraph": True})
        losses = _train(engine, rank)
        graphs = rec.graphs
        again = Recorder()
        engine.compile(backend=again)  # a no-op: nothing recompiles with the new backend
        engine(torch.randn(MICRO, IN, device=engine.device))
        out[f"stage{stage}"] = {
            "eager": eager_losses,
            "compiled": losses,
            "graphs": graphs,
            "breaks": sum(counters["graph_break"].values()),
            "second_graphs": again.graphs,
            "is_compiled": (before, engine.is_compiled),
            "keys": sorted(engine.module.state_dict()),
            "regions": None if engine._compile_state.regions is None else [n for n, _ in engine._compile_state.regions],
        }
        engine.close()
    return out


def adopted_torch_compile(ckpt_dir: str) -> dict[str, Any]:
    """initialize(model=torch.compile(model)) at ZeRO 2: losses, graphs, keys; checkpoints both ways."""
    import torch
    import torch.distributed as dist

    import dscore

    eager, *_ = dscore.initialize(model=_model(), config=_config(2))
    rank = dist.get_rank()
    eager_losses = _train(eager, rank)
    eager.save_checkpoint(ckpt_dir, tag="plain")
    plain_weights = [p.detach().clone() for p in eager.module.parameters()]

    torch._dynamo.reset()
    rec = Recorder()
    engine, *_ = dscore.initialize(model=torch.compile(_model(), backend=rec), config=_config(2))
    compiled_losses = _train(engine, rank)
    out: dict[str, Any] = {
        "eager": eager_losses,
        "compiled": compiled_losses,
        "graphs": rec.graphs,
        "is_compiled": engine.is_compiled,
        "module_type": type(engine.module).__name__,
        "keys": sorted(engine.module.state_dict()),
    }
    engine.save_checkpoint(ckpt_dir, tag="compiled")
    compiled_weights = [p.detach().clone() for p in engine.module.parameters()]
    # a plain checkpoint into the compiled-model engine (weights wiped first, so the load must restore them)
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    engine.load_checkpoint(ckpt_dir, tag="plain")
    out["plain_into_compiled"] = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), plain_weights))
    engine.close()
    # the compiled-model checkpoint into a plain-model engine
    fresh, *_ = dscore.initialize(model=_model(), config=_config(2))
    with torch.no_grad():
        for p in fresh.module.parameters():
            p.zero_()
    fresh.load_checkpoint(ckpt_dir, tag="compiled")
    out["compiled_into_plain"] = all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), compiled_weights))
    eager.close()
    fresh.close()
    return out


def compiled_autograd_run(stage: int) -> dict[str, Any]:
    """engine.compile(compiled_autograd_enabled=True): backward graphs captured, losses equal eager."""
    import torch
    import torch.distributed as dist

    import dscore

    eager, *_ = dscore.initialize(model=_model(), config=_config(stage))
    rank = dist.get_rank()
    eager_losses = _train(eager, rank)
    eager.close()
    torch._dynamo.reset()
    engine, *_ = dscore.initialize(model=_model(), config=_config(stage))
    rec = Recorder()
    engine.runtime.accelerator.set_compile_backend("eager")
    engine.compile(backend=rec, compiled_autograd_enabled=True)
    seen: list[bool] = []
    from torch._dynamo import compiled_autograd

    orig = engine.zero_stage_impl.backward

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(bool(compiled_autograd.compiled_autograd_enabled))
        return orig(*args, **kwargs)

    engine.zero_stage_impl.backward = spy
    from torch._dynamo.utils import counters

    counters.clear()
    losses = _train(engine, rank)
    engine.close()
    return {
        "eager": eager_losses,
        "compiled": losses,
        "graphs": rec.graphs,
        "ca_on_in_backward": seen,
        "ca_captures": int(counters["compiled_autograd"]["captures"]),
    }


def compile_refusals() -> dict[str, Any]:
    """engine.compile's refusals and its `backend` in compile_kwargs warning."""
    import logging

    import torch

    import dscore
    from dscore.errors import ConfigError

    out: dict[str, Any] = {}
    engine, *_ = dscore.initialize(model=_model(), config=_config(0))
    for name, kwargs in {
        "schedule": {"schedule": [(0, [])]},
        "unknown_backend": {"backend": "no-such-backend"},
        "kwargs_type": {"compile_kwargs": [("fullgraph", True)]},
    }.items():
        try:
            engine.compile(**kwargs)
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    out["compiled_after_refusals"] = engine.is_compiled
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Grab(level=logging.WARNING)
    logging.getLogger("dscore.runtime.compile").addHandler(handler)
    rec = Recorder()
    engine.compile(backend=rec, compile_kwargs={"backend": "inductor"})  # the argument wins, with a warning
    engine(torch.randn(MICRO, IN, device=engine.device))
    logging.getLogger("dscore.runtime.compile").removeHandler(handler)
    out["warnings"] = records
    out["graphs"] = rec.graphs
    out["default_backend"] = engine.runtime.accelerator.get_compile_backend()
    engine.close()
    return out


LLAMA_VOCAB, LLAMA_SEQ, LLAMA_LAYERS = 64, 8, 2


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LLAMA_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def _train_llama(engine: Any, rank: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, LLAMA_VOCAB, (2 * MICRO, LLAMA_SEQ), generator=g)[rank * MICRO : (rank + 1) * MICRO]
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def llama_compile(zero: dict[str, Any]) -> dict[str, Any]:
    """A tiny LlamaForCausalLM under ``zero``: eager losses, then engine.compile() losses, graphs, breaks and
    the number of modules carrying ZeRO-3 gather/release hooks (0 below stage 3)."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dscore

    config = {**_config(0), "zero_optimization": zero}
    eager, *_ = dscore.initialize(model=_llama(), config=config)
    rank = dist.get_rank()
    eager_losses = _train_llama(eager, rank)
    eager.close()
    torch._dynamo.reset()
    counters.clear()
    engine, *_ = dscore.initialize(model=_llama(), config=config)
    rec = Recorder()
    engine.compile(backend=rec)
    losses = _train_llama(engine, rank)
    hooked = len(getattr(engine.zero_stage_impl, "module_units", {}))
    regions = engine._compile_state.regions
    out = {
        "regions": None if regions is None else [name for name, _ in regions],
        "eager": eager_losses,
        "compiled": losses,
        "graphs": rec.graphs,
        "breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted(counters["graph_break"]),
        "hooked_modules": hooked,
    }
    engine.close()
    if zero["stage"] == 3:  # initialize(model=torch.compile(model)) takes the same regions
        torch._dynamo.reset()
        counters.clear()
        adopted, *_ = dscore.initialize(model=torch.compile(_llama(), backend=Recorder()), config=config)
        out["adopted"] = _train_llama(adopted, rank)
        out["adopted_breaks"] = sum(counters["graph_break"].values())
        out["adopted_regions"] = len(adopted._compile_state.regions or [])
        adopted.close()
    return out
