"""Training job of the multi-node tier: a tiny model at ZeRO stage 2, a few steps, gloo.

Every rank writes ``<out>/rank<R>.json`` with what the process itself saw: rank, local rank and world
size (from the environment, from ``torch.distributed`` and from the engine), the master address, its
own addresses, its argv, selected environment variables, the per-step losses and the final parameters.

``--mode``: ``engine`` (default: ``dscore.initialize`` discovers everything), ``existing-group`` (the
script creates the process group itself from the launcher's MPI/SLURM variables, then calls
``dscore.initialize``). ``--fail_rank R --fail_how raise|kill``: rank R raises (exit code 1) or
SIGKILLs itself after the group exists, while the other ranks sleep long (so only the launcher can
stop them); each rank writes ``<out>/pid<R>`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import dscore

ENV_KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "MPI_LOCALRANKID", "SLURM_PROCID",
    "SLURM_LOCALID", "NCCL_MN_TEST", "PYTHONMN_TEST", "PYTHONPATH", "VENV_SCRIPT_RAN", "GLOO_SOCKET_IFNAME", "HOME",
    "MN_SPACES", "MN_EQ", "MN_QUOTES", "MN_LIB", "MN_BRACED", "MN_INJECT", "MN_SUBST", "MN_NODE_HOME",
)


def hold(args: argparse.Namespace) -> None:
    """Failure/SIGTERM jobs: write ``pid<R>``, then fail (``--fail_rank``) or wait until stopped."""
    rank = dist.get_rank()
    with open(os.path.join(args.out, f"pid{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    if rank == args.fail_rank:
        time.sleep(1.0)  # let the other ranks reach their wait
        if args.fail_how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure on rank {rank}")
    if args.fail_rank >= 0 and args.survivors == "barrier":
        dist.barrier()  # gloo raises when the peer's connection closes
    time.sleep(600)  # only the launcher can end this rank early


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", choices=["engine", "existing-group"], default="engine")
    p.add_argument("--fail_rank", type=int, default=-1)
    p.add_argument("--fail_how", choices=["raise", "kill"], default="raise")
    p.add_argument("--hold", action="store_true", help="after init every rank sleeps (SIGTERM tests)")
    p.add_argument("--survivors", choices=["sleep", "barrier"], default="sleep")
    args = p.parse_args()
    torch.set_num_threads(1)
    env_before = {k: os.environ.get(k) for k in ENV_KEYS}

    if args.mode == "existing-group":
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or os.environ["SLURM_PROCID"])
        world = int(
            os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or os.environ["SLURM_NTASKS"]
        )
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)

    if args.hold or args.fail_rank >= 0:
        # the failure and SIGTERM jobs need every rank in one group, not an engine (keeps the tier short)
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        hold(args)
        return

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = dscore.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    losses = []
    for _ in range(args.steps):
        x = torch.randn(4, 6, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    params = torch.cat([q.detach().flatten() for q in engine.module.parameters()]).tolist()
    try:
        addrs = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except OSError:
        addrs = []
    record = {
        "rank": rank,
        "world": world,
        "engine_local_rank": int(engine.local_rank),
        "env_before": env_before,
        "env_after": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")},
        "argv": sys.argv[1:],
        "tag": args.tag,
        "addrs": addrs,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "losses": losses,
        "params": params,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(record, fh)
    dist.barrier()


if __name__ == "__main__":
    main()
