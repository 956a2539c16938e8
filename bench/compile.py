"""torch.compile speed-up per ZeRO stage: ``engine.compile(backend="inductor")`` vs the same engine eager.

Two gloo ranks, one thread each. Per (framework, model, stage) one spawn builds two engines from the same
weights, one compiled in place with ``engine.compile(backend=...)`` and one left eager, warms both up (the
compile happens there, outside every timed region), then times them in alternating blocks of ``--steps``
training steps, ``--rounds`` times each; reported: the median steps/s of each and compiled / eager.

Models: ``mlp`` (``--layers`` x ``Linear(hidden, hidden)`` with ReLU, 4 x 1024 by default, micro batch 64,
as dp_throughput.py) and ``gpt`` (examples/gpt's model at its default size, micro batch 8, block 128).
Frameworks: ``dscore`` and, when DeepSpeed 0.19.8 is importable (the bench venv, bench/README.md),
``deepspeed`` (its ``engine.compile()``, same config plus ``foreach``, see _deepspeed_peer.py), and torch's
FSDP2 as the stage-3 peer (its rows are stage 3 only; ``fully_shard`` on a CPU mesh over gloo, each
``Linear`` of the MLP / each GPT block a unit, then the root; AdamW ``foreach``, clipping 1.0 as the
engines): ``fsdp2-block`` compiles each unit (``module.compile()``, torch's recommended use) and
``fsdp2-whole`` the whole model (``torch.compile(model)``).

Targets (issue 41): compiled >= eager at every stage, stage 3 compiled >= 1.15x its eager, dscore stage 3
compiled >= FSDP2 compiled (steps/s).

Usage::

    python bench/compile.py --steps 5 --rounds 3
    /work/bench-venv/bin/python bench/compile.py --frameworks dscore,deepspeed --models mlp --stages 0,3
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GPT_DIR = HERE.parent / "examples" / "gpt"
log = logging.getLogger("dscore.bench.compile")


def _config(stage: int, micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "overlap_comm": True},
    }


def _model(name: str, hidden: int, layers: int) -> tuple[Any, Any, int]:
    """``(module, batch(step) -> args, micro batch)`` for ``name``; each rank draws its own batches."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    if name == "mlp":
        mods: list[torch.nn.Module] = []
        for i in range(layers):
            mods.append(torch.nn.Linear(hidden, hidden, device="cpu"))
            if i < layers - 1:
                mods.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*mods)

        def batch(step: int) -> tuple[Any, ...]:
            g = torch.Generator().manual_seed(1009 * step + rank)
            return (torch.randn(64, hidden, generator=g, device="cpu"),)

        return model, batch, 64
    sys.path.insert(0, str(GPT_DIR))
    from model import GPT, GPTConfig

    cfg = GPTConfig()
    model = GPT(cfg)

    def gpt_batch(step: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(1009 * step + rank)
        seq = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g, device="cpu")
        return seq[:, :-1], seq[:, 1:]

    return model, gpt_batch, 8


class _FSDP2:
    """torch FSDP2 driven like an engine (``engine(*args)``, ``backward``, ``step``) for the same loop."""

    def __init__(self, model: Any, units: list[Any]) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.units = model, units
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def compile(self, backend: str, whole: bool) -> None:
        import torch

        if whole:
            self.model = torch.compile(self.model, backend=backend)
        else:
            for unit in self.units:
                unit.compile(backend=backend)

    def __call__(self, *args: Any) -> Any:
        return self.model(*args)

    def backward(self, loss: Any) -> None:
        loss.backward()

    def step(self) -> None:
        import torch

        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _units(model: Any) -> list[Any]:
    import torch

    blocks = getattr(model, "blocks", None)
    return list(blocks) if blocks is not None else [m for m in model if isinstance(m, torch.nn.Linear)]


def _loss(out: Any) -> Any:
    # the GPT returns its LM loss given targets; the MLP's output is reduced to a scalar
    return out if out.dim() == 0 else (out * out).mean()


def _worker(framework: str, model_name: str, stage: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("dscore").setLevel(logging.WARNING)
    engines = {}
    for mode in ("eager", "compiled"):
        model, batch, micro = _model(model_name, args["hidden"], args["layers"])
        if framework.startswith("fsdp2"):
            engine = _FSDP2(model, _units(model))
            if mode == "compiled":
                engine.compile(args["backend"], whole=framework == "fsdp2-whole")
            engines[mode] = engine
            continue
        if framework == "deepspeed":
            sys.path.insert(0, str(HERE))
            import _deepspeed_peer

            engine, _ = _deepspeed_peer.initialize(model, _config(stage, micro))
        else:
            import dscore

            engine, *_ = dscore.initialize(model=model, config=_config(stage, micro))
        if mode == "compiled":
            engine.compile(backend=args["backend"])
        engines[mode] = engine

    def steps(engine: Any, start: int, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(start, start + n):
            engine.backward(_loss(engine(*batch(s))))
            engine.step()
        dist.barrier()
        return n / (time.perf_counter() - t0)

    from torch._dynamo.utils import counters

    counters.clear()
    for engine in engines.values():
        steps(engine, 0, args["warmup"])
    breaks = sum(counters["graph_break"].values())
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    order = ["eager", "compiled"]
    for r in range(args["rounds"]):
        for mode in order if r % 2 == 0 else order[::-1]:  # alternate which goes first
            rates[mode].append(steps(engines[mode], 1000 * (r + 1), args["steps"]))
    return {
        "eager": statistics.median(rates["eager"]),
        "compiled": statistics.median(rates["compiled"]),
        "breaks_in_warmup": breaks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default="dscore,deepspeed,fsdp2-block,fsdp2-whole")
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=3, help="timed blocks per engine")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine (the compile happens here)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--out", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    frameworks = a.frameworks.split(",")
    if "deepspeed" in frameworks:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            log.info("DeepSpeed not importable by this interpreter: its rows are skipped (see bench/README.md)")
            frameworks.remove("deepspeed")
    from dscore.testing import run_distributed

    opts = {k: getattr(a, k) for k in ("steps", "rounds", "warmup", "hidden", "layers", "backend")}
    lines = [
        f"compile bench: 2 gloo ranks, backend {a.backend}, {a.rounds} alternating blocks of {a.steps} steps "
        f"after {a.warmup} warm-up steps; torch threads 1",
        f"{'framework':<10} {'model':<5} {'stage':>5} {'eager st/s':>11} {'compiled st/s':>14} {'ratio':>7} "
        f"{'breaks(warmup)':>15}",
    ]
    log.info(lines[0])
    log.info(lines[1])
    failed = 0
    for model in a.models.split(","):
        for stage in (int(s) for s in a.stages.split(",")):
            for fw in frameworks:
                if fw.startswith("fsdp2") and stage != 3:
                    continue  # FSDP2 shards parameters: the stage-3 peer only
                env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
                try:
                    res = run_distributed(_worker, 2, fw, model, stage, opts, env=env, timeout=1800)
                except Exception as exc:  # one failed row must not hide the others
                    failed += 1
                    line = f"{fw:<10} {model:<5} {stage:>5} FAILED: {str(exc).splitlines()[-1][:200]}"
                else:
                    e = min(r["eager"] for r in res)  # the slower rank sets the pace (equal after the barrier)
                    c = min(r["compiled"] for r in res)
                    line = (
                        f"{fw:<10} {model:<5} {stage:>5} {e:>11.2f} {c:>14.2f} {c / e:>7.3f} "
                        f"{res[0]['breaks_in_warmup']:>15}"
                    )
                lines.append(line)
                log.info(line)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
