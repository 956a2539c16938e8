"""Per-rank memory of tensor and sequence parallelism, as ratios against one rank measured in the same run.

* **parameter bytes at tp 2 vs tp 1**: the bytes of a Llama-style stack's parameters held by one rank after
  AutoTP (``dscore.parallel.autotp.apply_autotp``) over 2 gloo ranks, divided by the unsplit model's bytes.
  Norm weights and row biases stay replicated, so the ratio is slightly above 0.5.
* **activation bytes at sp 2 vs sp 1 for the attention block**: the bytes autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``) during one forward of an attention block (projections,
  rotary embedding, attention, output projection) on the full sequence at sp 1, and on a sequence shard
  with Ulysses (``UlyssesSPAttentionHF``) at sp 2; per rank.

Usage: ``python bench/tp_sp_memory.py [--hidden 256] [--layers 4] [--seq 1024]``. The model is the test
suite's ``tests/distributed/tp_sp_model.py`` scaled by the arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "distributed"))

log = logging.getLogger("bench.tp_sp_memory")


def _scale(hidden: int, layers: int) -> Any:
    import tp_sp_model as m

    m.HIDDEN, m.LAYERS, m.FFN, m.VOCAB = hidden, layers, 4 * hidden, 1024
    m.HEADS = 8
    m.HEAD_DIM = hidden // m.HEADS
    return m


def _param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _saved_bytes(fn: Any) -> int:
    import torch

    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return total


def _attention_bytes(m: Any, seq: int, sp_comm: Any, sp: int, rank: int) -> int:
    import torch

    from dscore.parallel.ulysses import UlyssesSPAttentionHF

    torch.manual_seed(0)
    attn = m.Attention()
    if sp > 1:
        attn.core = UlyssesSPAttentionHF(
            m.sdpa_core, seq // sp, seq, 1, m.HEADS, m.HEAD_DIM, m.HEADS, m.LAYERS, sp_comm
        )
    local = seq // sp
    x = torch.randn(1, local, m.HIDDEN, requires_grad=True)
    pos = torch.arange(rank * local, (rank + 1) * local).unsqueeze(0)
    return _saved_bytes(lambda: attn(x, pos))


def _rank(hidden: int, layers: int, seq: int) -> dict[str, int]:
    from dscore.comm.facade import Comm
    from dscore.config.parallel import TensorParallelConfig
    from dscore.parallel.autotp import apply_autotp
    from dscore.parallel.mesh import ParallelMesh

    m = _scale(hidden, layers)
    comm = Comm(None)
    tp_mesh = ParallelMesh.create(comm, tp=2)
    model = m.make_model()
    apply_autotp(model, tp_mesh, TensorParallelConfig(autotp_size=2))
    sp_mesh = ParallelMesh.create(comm, sp=2)
    return {
        "params_tp2": _param_bytes(model),
        "attn_sp2": _attention_bytes(m, seq, sp_mesh.sp_comm, 2, sp_mesh.sp_rank),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from dscore.testing import run_distributed

    m = _scale(args.hidden, args.layers)
    params_tp1 = _param_bytes(m.make_model())
    attn_sp1 = _attention_bytes(m, args.seq, None, 1, 0)
    ranks = run_distributed(_rank, 2, args.hidden, args.layers, args.seq, timeout=600)
    out = {
        "hidden": args.hidden,
        "layers": args.layers,
        "seq": args.seq,
        "params_tp1_bytes": params_tp1,
        "params_tp2_bytes_per_rank": [r["params_tp2"] for r in ranks],
        "params_ratio_tp2_vs_tp1": max(r["params_tp2"] for r in ranks) / params_tp1,
        "attn_activation_sp1_bytes": attn_sp1,
        "attn_activation_sp2_bytes_per_rank": [r["attn_sp2"] for r in ranks],
        "attn_activation_ratio_sp2_vs_sp1": max(r["attn_sp2"] for r in ranks) / attn_sp1,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
