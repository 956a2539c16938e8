"""A 2-rank dscore job that must run where numpy cannot be imported (issue 38 item 0).

Run by ``dscore run --num_gpus 2 no_numpy_job.py --out DIR`` (tests/integration/test_no_numpy.py, with numpy
installed but refused here; tools/clean_install_check.sh, in a venv that has no numpy at all). Before torch is
imported, ``numpy`` is made unimportable in this process, so any numpy use on the path below fails as
it would on a clean install. Then, for ZeRO stages 0 and 3: ``dscore.initialize``, three steps, a checkpoint
saved and loaded into a freshly seeded engine, one more step. Each rank writes ``DIR/rank<R>.json`` with its
losses, a checksum of the parameters before saving and after loading, and whether numpy got imported.
"""

from __future__ import annotations

import sys

# A None entry is the import system's "not importable" marker: ``import numpy`` raises ModuleNotFoundError and
# ``importlib.util.find_spec("numpy")`` returns None, exactly as where numpy is not installed (a meta-path
# finder cannot say "absent" to find_spec while a later finder still finds the installed package).
sys.modules["numpy"] = None  # type: ignore[assignment]

import argparse  # noqa: E402 - after the marker, so nothing below can import numpy
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402

import dscore  # noqa: E402

STEPS = 3


def _engine(stage: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    return engine


def _step(engine, gen: torch.Generator) -> float:
    x = torch.randn(4, 6, generator=gen, device="cpu").to(engine.device)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach().to("cpu"))


def _checksum(engine) -> list[float]:
    """Sum and sum of squares of the full (gathered) parameters, the same on every rank and stage."""
    state = engine.zero_stage_impl.module_state_dict()
    flat = torch.cat([state[k].detach().to("cpu", torch.float64).flatten() for k in sorted(state)])
    return [float(flat.sum()), float(flat.pow(2).sum())]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    report: dict = {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "stages": {}}
    for stage in (0, 3):
        gen = torch.Generator(device="cpu").manual_seed(100 + rank)  # different data per rank
        engine = _engine(stage, seed=0)
        losses = [_step(engine, gen) for _ in range(STEPS)]
        saved = _checksum(engine)
        ckpt = os.path.join(args.out, f"ckpt_stage{stage}")
        engine.save_checkpoint(ckpt, client_state={"stage": stage})
        fresh = _engine(stage, seed=1)
        _, client = fresh.load_checkpoint(ckpt)
        loaded = _checksum(fresh)
        after = _step(fresh, gen)
        report["stages"][str(stage)] = {
            "losses": losses, "saved": saved, "loaded": loaded, "client": client,
            "global_steps": fresh.global_steps, "after_load_loss": after,
        }
    report["numpy_imported"] = sys.modules.get("numpy") is not None
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main()
