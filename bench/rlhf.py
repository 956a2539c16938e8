"""RLHF paths of the hybrid engine (issue 40): generation speed, weight-export speed, a generate/train soak.

Parts (``--parts``, comma-separated; all on 2 gloo ranks, one thread each, ZeRO-3 with
``stage3_param_persistence_threshold`` 0 so every layer is partitioned):

* ``gen``: greedy ``engine.generate`` (hybrid engine, KV cache, parameters gathered once per call) vs the plain
  single-process Hugging Face model's ``generate`` (a copy of the same weights, in the same rank process) on the
  same prompts: ``--batch`` prompts of ``--prompt`` tokens, ``--new-tokens`` new ones (no EOS, so every call adds
  exactly that many; checked). Alternating timed calls, ``--rounds`` each; tokens/s = batch x new / seconds,
  median; the ratio engine / plain (target >= 0.9). The two outputs are also compared token for token.
* ``export``: ``engine.iter_full_params(bucket_bytes=--bucket-mib)`` drained (bytes/s of the full weights it
  yields) vs a memcpy bound in the same process: ``dst.copy_(src)`` of a flat buffer of the same bytes into
  preallocated memory, and (what the export really does: fresh full copies) ``clone()`` of the same full-size
  tensors. Alternating, median of ``--rounds``.
* ``deepspeed``: DeepSpeed 0.19.8's Hybrid Engine on the same model and config, when DeepSpeed is importable
  (the bench venv, bench/README.md): its ``deepspeed.initialize`` with ``hybrid_engine.enabled``; when that (or
  its ``generate``) raises, the row records the error instead of a rate.
* ``soak``: ``--cycles`` generate/train cycles (``engine.eval(); engine.generate(..., max_new_tokens=
  --soak-new)``, then ``engine.train()`` and one training step on fresh random tokens), ZeRO-3 without and with
  ``offload_param`` (cpu), each rank's RSS (``/proc/self/statm``) every ``--rss-every`` cycles. "Flat": the mean
  RSS of the samples in the last quarter of the cycles minus that of the second quarter is at most
  ``--rss-bound-mib`` (default 8 MiB) on every rank. Any exception fails the row.

Usage::

    /work/wt/py bench/rlhf.py --parts gen,export,soak --out bench/results/rlhf_<date>.txt
    PYTHONPATH=.:plugins:accelerators /work/bench-venv/bin/python bench/rlhf.py --parts deepspeed

Exit code 1 when a dscore row failed, the soak raised or was not flat, or the generated tokens differ.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("dscore.bench.rlhf")
PAD = 0


def _model(layers: int, hidden: int, vocab: int) -> Any:
    """A Llama from a LlamaConfig (no download), same weights on every rank; EOS off so generate runs to the end."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512, pad_token_id=PAD, bos_token_id=1, eos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def _config(offload_param: bool, micro: int, max_out: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero,
        "hybrid_engine": {"enabled": True, "max_out_tokens": max_out},
    }


def _prompts(batch: int, length: int, vocab: int, seed: int, device: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


def _gen_kwargs(new: int) -> dict[str, Any]:
    return {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "use_cache": True,
            "pad_token_id": PAD, "eos_token_id": None}


def _timed(fn: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    dist.barrier()
    return dt, out


def gen_worker(a: dict[str, Any]) -> dict[str, Any]:
    """Rank function of ``gen`` and ``export``: engine vs plain model (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import dscore

    torch.set_num_threads(1)
    logging.getLogger("dscore").setLevel(logging.WARNING)
    model = _model(a["layers"], a["hidden"], a["vocab"])
    ref = copy.deepcopy(model).eval()
    engine, *_ = dscore.initialize(model=model, config=_config(False, a["batch"], a["prompt"] + a["new_tokens"]))
    engine.eval()
    res: dict[str, Any] = {}
    rank = dist.get_rank()
    if "gen" in a["parts"]:
        ids = _prompts(a["batch"], a["prompt"], a["vocab"], 100 + rank, engine.device)
        mask = torch.ones_like(ids)
        kw = _gen_kwargs(a["new_tokens"])
        calls = {
            "engine": lambda: engine.generate(ids, attention_mask=mask, **kw),
            "plain": lambda: ref.generate(ids.cpu(), attention_mask=mask.cpu(), **kw),
        }
        outs = {k: f() for k, f in calls.items()}  # warm-up, and the outputs compared
        res["same_tokens"] = outs["engine"].cpu().tolist() == outs["plain"].tolist()
        res["new_tokens"] = int(outs["engine"].shape[1]) - a["prompt"]
        rates: dict[str, list[float]] = {k: [] for k in calls}
        order = list(calls)
        for r in range(a["rounds"]):
            for k in order if r % 2 == 0 else order[::-1]:
                with torch.no_grad():
                    dt, _ = _timed(calls[k])
                rates[k].append(a["batch"] * a["new_tokens"] / dt)
        res["gen"] = {k: statistics.median(v) for k, v in rates.items()}
        res["gen_all"] = rates
        # one new token: the prefill plus, for the engine, the once-per-call gather and release
        kw1 = _gen_kwargs(1)
        one = {"engine": lambda: engine.generate(ids, attention_mask=mask, **kw1),
               "plain": lambda: ref.generate(ids.cpu(), attention_mask=mask.cpu(), **kw1)}
        secs: dict[str, list[float]] = {k: [] for k in one}
        for r in range(a["rounds"]):
            for k in order if r % 2 == 0 else order[::-1]:
                with torch.no_grad():
                    secs[k].append(_timed(one[k])[0])
        res["one_token_s"] = {k: statistics.median(v) for k, v in secs.items()}
    if "export" in a["parts"]:
        bucket = a["bucket_mib"] << 20
        full = [t.detach() for t in ref.state_dict().values()]
        nbytes = sum(t.numel() * t.element_size() for t in full)
        src = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        dst = torch.empty_like(src)
        src.fill_(1)
        dst.fill_(0)  # both buffers touched before timing

        def export() -> int:
            n = 0
            for b in engine.iter_full_params(bucket_bytes=bucket):
                n += sum(t.numel() * t.element_size() for _, t in b)
            return n

        def memcpy() -> int:
            dst.copy_(src)
            return nbytes

        fns = {
            "export": export,
            "memcpy": memcpy,
            "clone": lambda: sum(t.clone().numel() * t.element_size() for t in full),
        }
        got = export()  # warm-up; also the byte count checked against the model's
        res["export_bytes"], res["model_bytes"] = got, nbytes
        erates: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns)
        for r in range(a["rounds"]):
            for k in order if r % 2 == 0 else order[::-1]:
                dt, _ = _timed(fns[k])
                erates[k].append(nbytes / dt)
        res["export"] = {k: statistics.median(v) for k, v in erates.items()}
    engine.close()
    return res


def deepspeed_worker(a: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed 0.19.8's Hybrid Engine on the same model and config: its generate rate, or the error it raised."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    model = _model(a["layers"], a["hidden"], a["vocab"])
    ref = copy.deepcopy(model).eval()
    cfg = _config(False, a["batch"], a["prompt"] + a["new_tokens"])
    cfg["optimizer"]["params"]["foreach"] = True
    res: dict[str, Any] = {"version": deepspeed.__version__}
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:  # recorded as the row, with where DeepSpeed raised it
        import traceback

        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
        res["error"] = f"deepspeed.initialize: {type(exc).__name__}: {exc} (at {where})"
        return res
    res["engine_class"] = type(engine).__name__
    ids = _prompts(a["batch"], a["prompt"], a["vocab"], 100 + dist.get_rank(), engine.device)
    mask = torch.ones_like(ids)
    kw = _gen_kwargs(a["new_tokens"])
    try:
        engine.eval()
        out = engine.generate(ids, attention_mask=mask, **kw)
        res["same_tokens"] = out.cpu().tolist() == ref.generate(ids.cpu(), attention_mask=mask.cpu(), **kw).tolist()
        rates: dict[str, list[float]] = {"deepspeed": [], "plain": []}
        for r in range(a["rounds"]):
            for k in ("deepspeed", "plain") if r % 2 == 0 else ("plain", "deepspeed"):
                fn = engine.generate if k == "deepspeed" else ref.generate
                with torch.no_grad():
                    dt, _ = _timed(lambda fn=fn: fn(ids, attention_mask=mask, **kw))
                rates[k].append(a["batch"] * a["new_tokens"] / dt)
        res["gen"] = {k: statistics.median(v) for k, v in rates.items()}
    except Exception as exc:
        res["error"] = f"engine.generate: {type(exc).__name__}: {exc}"
    return res


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak_worker(a: dict[str, Any], offload_param: bool) -> dict[str, Any]:
    """``a['cycles']`` generate/train cycles on one ZeRO-3 engine; RSS (MiB) at cycle 0 and every rss_every."""
    import torch
    import torch.distributed as dist

    import dscore

    torch.set_num_threads(1)
    logging.getLogger("dscore").setLevel(logging.WARNING)
    model = _model(a["soak_layers"], a["soak_hidden"], a["soak_vocab"])
    micro, plen, new = 2, 8, a["soak_new"]
    engine, *_ = dscore.initialize(model=model, config=_config(offload_param, micro, plen + new))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    samples: list[tuple[int, float]] = [(0, _rss_mib())]
    losses: list[float] = []
    t0 = time.perf_counter()
    for cycle in range(1, a["cycles"] + 1):
        engine.eval()
        ids = torch.randint(3, a["soak_vocab"], (micro, plen), generator=g).to(engine.device)
        out = engine.generate(ids, attention_mask=torch.ones_like(ids), **_gen_kwargs(new))
        if out.shape[1] != plen + new:
            raise RuntimeError(f"cycle {cycle}: generate returned {tuple(out.shape)}")
        engine.train()
        seq = out.detach()  # train on the rollout, as an RLHF step would
        loss = engine(input_ids=seq, labels=seq).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if cycle % a["rss_every"] == 0:
            samples.append((cycle, _rss_mib()))
    wall = time.perf_counter() - t0
    engine.close()
    return {"samples": samples, "wall_s": wall, "first_loss": losses[0], "last_loss": losses[-1],
            "finite": all(x == x and abs(x) != float("inf") for x in losses)}


def _flat(samples: list[tuple[int, float]], cycles: int) -> tuple[float, float]:
    """Mean RSS (MiB) of the samples in the second and in the last quarter of the cycles."""
    q2 = [r for c, r in samples if cycles / 4 < c <= cycles / 2]
    q4 = [r for c, r in samples if c > 3 * cycles / 4]
    return statistics.mean(q2), statistics.mean(q4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="gen,export,deepspeed,soak")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bucket-mib", type=int, default=16)
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--rss-every", type=int, default=100)
    p.add_argument("--rss-bound-mib", type=float, default=8.0)
    p.add_argument("--soak-layers", type=int, default=2)
    p.add_argument("--soak-hidden", type=int, default=128)
    p.add_argument("--soak-vocab", type=int, default=512)
    p.add_argument("--soak-new", type=int, default=4)
    p.add_argument("--soak-offload", default="0,1", help="offload_param settings to soak (0 none, 1 cpu)")
    p.add_argument("--out", default=None, help="also append the lines to this file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parts = a.parts.split(",")
    opts = {k.replace("-", "_"): v for k, v in vars(a).items()}
    opts["parts"] = parts
    from dscore.testing import run_distributed

    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    lines = [f"$ {' '.join([Path(sys.executable).name, *sys.argv])}",
             f"rlhf bench: 2 gloo ranks, 1 thread each, ZeRO-3; Llama {a.layers}x{a.hidden}, vocab {a.vocab}"]
    failed = 0

    def emit(line: str) -> None:
        lines.append(line)
        log.info(line)

    emit(lines.pop())
    if "gen" in parts or "export" in parts:
        res = run_distributed(gen_worker, 2, opts, env=env, timeout=3000)
        if "gen" in parts:
            emit(f"gen: batch {a.batch}, prompt {a.prompt}, {a.new_tokens} new tokens, greedy, KV cache; "
                 f"median of {a.rounds} alternating calls each; tokens/s per rank")
            for rank, r in enumerate(res):
                e, pl = r["gen"]["engine"], r["gen"]["plain"]
                ok = r["same_tokens"] and r["new_tokens"] == a.new_tokens
                failed += 0 if ok else 1
                paired = statistics.median(x / y for x, y in zip(r["gen_all"]["engine"], r["gen_all"]["plain"]))
                emit(f"  rank {rank}: engine.generate {e:8.1f}  plain HF generate {pl:8.1f}  ratio {e / pl:.3f} "
                     f"(median of per-round ratios {paired:.3f})  "
                     f"same tokens {r['same_tokens']}  new tokens {r['new_tokens']}")
                o = r["one_token_s"]
                emit(f"    1 new token: engine {1e3 * o['engine']:.1f} ms, plain {1e3 * o['plain']:.1f} ms per call "
                     f"(difference: the gather and release, paid once per generate call)")
                emit("    per round engine " + " ".join(f"{x:.1f}" for x in r["gen_all"]["engine"])
                     + " | plain " + " ".join(f"{x:.1f}" for x in r["gen_all"]["plain"]))
        if "export" in parts:
            emit(f"export: iter_full_params(bucket_bytes={a.bucket_mib} MiB) drained vs memcpy into preallocated "
                 f"memory and clone() of the full tensors, same process; median of {a.rounds}; MB/s per rank")
            for rank, r in enumerate(res):
                x = r["export"]
                failed += 0 if r["export_bytes"] == r["model_bytes"] else 1
                emit(f"  rank {rank}: {r['model_bytes'] / 1e6:.1f} MB (exported {r['export_bytes'] / 1e6:.1f})  "
                     f"export {x['export'] / 1e6:8.1f}  memcpy {x['memcpy'] / 1e6:8.1f}  clone {x['clone'] / 1e6:8.1f}"
                     f"  export/memcpy {x['export'] / x['memcpy']:.3f}  export/clone {x['export'] / x['clone']:.3f}")
    if "deepspeed" in parts:
        import importlib.util

        spec = importlib.util.find_spec("deepspeed")
        ds_version = ""
        if spec is not None:
            import deepspeed

            ds_version = str(deepspeed.__version__)
        if spec is None or "+dscore" in ds_version:  # none, or compat/deepspeed: dscore under DeepSpeed's name
            emit(f"deepspeed: skipped: DeepSpeed 0.19.8 not importable by {sys.executable} "
                 f"({ds_version or 'no deepspeed'}; use the bench venv, bench/README.md)")
        else:
            try:
                res = run_distributed(deepspeed_worker, 2, opts, env=env, timeout=3000)
            except Exception as exc:  # the row records it, the bench goes on
                emit(f"deepspeed: the ranks failed: {str(exc).strip().splitlines()[-1][:400]}")
            else:
                for rank, r in enumerate(res):
                    if "error" in r:
                        emit(f"  deepspeed {r['version']} rank {rank}: ERROR {r['error'][:600]}")
                    else:
                        d, pl = r["gen"]["deepspeed"], r["gen"]["plain"]
                        emit(f"  deepspeed {r['version']} rank {rank} ({r['engine_class']}): generate {d:8.1f}  "
                             f"plain {pl:8.1f}  ratio {d / pl:.3f}  same tokens {r['same_tokens']}")
    if "soak" in parts:
        emit(f"soak: {a.cycles} cycles of (generate {a.soak_new} tokens, batch 2, prompt 8; one training step on "
             f"the rollout), Llama {a.soak_layers}x{a.soak_hidden} vocab {a.soak_vocab}; RSS every {a.rss_every} "
             f"cycles; flat = mean(last quarter) - mean(second quarter) <= {a.rss_bound_mib} MiB on every rank")
        for off in (int(s) for s in a.soak_offload.split(",")):
            name = "offload_param cpu" if off else "no offload"
            try:
                res = run_distributed(soak_worker, 2, opts, bool(off), env=env, timeout=7200)
            except Exception as exc:
                failed += 1
                emit(f"  {name}: RAISED {str(exc).strip().splitlines()[-1][:400]}")
                continue
            for rank, r in enumerate(res):
                q2, q4 = _flat(r["samples"], a.cycles)
                flat = q4 - q2 <= a.rss_bound_mib
                failed += 0 if flat and r["finite"] else 1
                emit(f"  {name} rank {rank}: {r['wall_s']:.0f} s ({1000 * r['wall_s'] / a.cycles:.0f} ms/cycle), "
                     f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}; RSS q2 mean {q2:.1f} MiB, q4 mean "
                     f"{q4:.1f} MiB, growth {q4 - q2:+.1f} MiB -> {'flat' if flat else 'NOT FLAT'}")
                emit("    RSS MiB at cycle " + " ".join(f"{c}:{m:.1f}" for c, m in r["samples"]))
    if a.out:
        with open(a.out, "a") as fh:
            fh.write("\n".join(lines) + "\n\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
