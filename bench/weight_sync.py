"""Weight sync throughput (issue 40 item 4): ``WeightSyncSender.send`` -> ``WeightSyncReceiver.receive`` MB/s on
this host, next to the memcpy bound (one torch copy of the same bytes) and the hand-rolled OpenRLHF-style sync of
tests/distributed/test_rlhf_weight_sync.py (per parameter ``GatheredParameters([p])`` + a gloo broadcast, the
receiver copying each into its model, one all-reduce at the end as the acknowledgement ``send`` waits for).

One training process (a dscore engine, ZeRO stage ``--stage``, world of 1) sends to one receiver process holding
the same model; the variants alternate round by round. Time: the sender's, from the call to the receiver's
acknowledgement (every byte loaded). Prints MB/s (10^6 bytes) of the median and of the best round, and the ratios.

    python bench/weight_sync.py [--layers 16] [--width 1024] [--bucket-mib 16] [--rounds 5] [--stage 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _plain_group(port: int, rank: int) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=300))


def _receiver(args: argparse.Namespace, port: int, plain_port: int) -> None:
    import torch.distributed as dist

    from dscore.rollout import WeightSyncGroup, WeightSyncReceiver

    torch.set_num_threads(1)
    model = _model(args.layers, args.width)
    g = WeightSyncGroup("127.0.0.1", port, 2, 1, timeout=300)
    rx = WeightSyncReceiver(g)
    pg = _plain_group(plain_port, 1)
    params = list(model.parameters())
    for _ in range(args.rounds + 1):  # the first round warms up
        rx.receive(model)
        with torch.no_grad():
            for p in params:
                buf = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                pg.broadcast([buf], dist.BroadcastOptions()).wait()
                p.copy_(buf)
        pg.allreduce([torch.zeros(1, device="cpu")]).wait()
    g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--bucket-mib", type=float, default=16.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    args = ap.parse_args()

    import torch.distributed as dist

    import dscore
    from dscore.rollout import WeightSyncGroup, WeightSyncSender
    from dscore.zero import GatheredParameters

    torch.set_num_threads(1)
    port, plain_port = _free_port(), _free_port()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(args, port, plain_port), daemon=True)
    proc.start()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    engine, *_ = dscore.initialize(model=_model(args.layers, args.width), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0}})
    g = WeightSyncGroup("127.0.0.1", port, 2, 0, timeout=300)
    sender = WeightSyncSender(engine, g, bucket_bytes=int(args.bucket_mib * (1 << 20)))
    pg = _plain_group(plain_port, 0)
    nbytes = sum(p.numel() * 4 for p in _model(args.layers, args.width).parameters())
    src = torch.randn(nbytes // 4, device="cpu")
    dst = torch.empty_like(src)

    times: dict[str, list[float]] = {"weight_sync": [], "hand_rolled": [], "memcpy": []}
    for r in range(args.rounds + 1):
        t = time.perf_counter()
        sender.send(r)
        t_ws = time.perf_counter() - t
        t = time.perf_counter()
        for p in engine.module.parameters():
            with GatheredParameters([p]):
                pg.broadcast([p.data.detach().clone()], dist.BroadcastOptions()).wait()
        pg.allreduce([torch.zeros(1, device="cpu")]).wait()
        t_hand = time.perf_counter() - t
        t = time.perf_counter()
        dst.copy_(src)
        t_copy = time.perf_counter() - t
        if r:
            times["weight_sync"].append(t_ws)
            times["hand_rolled"].append(t_hand)
            times["memcpy"].append(t_copy)
    proc.join(timeout=120)
    g.close()

    def mbs(k: str) -> float:
        return nbytes / 1e6 / sorted(times[k])[len(times[k]) // 2]  # median round

    rate = {k: mbs(k) for k in times}
    best = {k: nbytes / 1e6 / min(times[k]) for k in times}  # the least disturbed round (a loaded machine)
    print(f"weight sync bench: {nbytes / 1e6:.1f} MB of fp32 weights ({args.layers}x Linear({args.width})), "
          f"ZeRO {args.stage}, bucket {args.bucket_mib:g} MiB, {args.rounds} rounds (median), 1 sender + 1 receiver, "
          f"gloo on loopback")
    for k in times:
        print(f"  {k:12s} median {rate[k]:10.1f} MB/s   best {best[k]:10.1f} MB/s")
    for other in ("memcpy", "hand_rolled"):
        print(f"  weight_sync / {other:11s} = {rate['weight_sync'] / rate[other]:.3f} (median), "
              f"{best['weight_sync'] / best[other]:.3f} (best)")


if __name__ == "__main__":
    main()
