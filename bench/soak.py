"""Soak: N two-rank jobs through ``dscore run``, counting non-zero exits by cause and files left behind.

Each run trains a tiny MLP a few steps and saves a checkpoint; runs cycle through ZeRO stages 0-3, with
and without optimizer offload (stage 0 has no offload: 7 combinations), each on a random rendezvous port
(``--master_port`` drawn at random from 20000-59999; ``--free_ports`` lets the launcher pick instead).
The scripts end normally and never call ``destroy_process_group``: ending the group is dscore's job.

Counted per run: the exit code, classified by cause (``abort`` for SIGABRT / ``terminate called``,
``port_busy``, ``timeout``, ``exception: <type>``, ``exit <code>``), whether the checkpoint is complete,
new entries in ``/dev/shm`` that no live process holds afterwards (the directory is machine-wide) and anything left
in the run's own ``TMPDIR`` (private to the run, so exact; torch's ``torchinductor_<user>`` compile cache
is a cache by design and not counted).

``--peer deepspeed`` runs the same jobs with DeepSpeed's launcher and API (DeepSpeed 0.19.8, from the
``bench`` extra, or ``--python`` of a venv that has it); it says so and exits 0 when DeepSpeed is not
importable.

Usage: ``python bench/soak.py --runs 200 [--peer dscore|deepspeed] [--steps 3] [--parallel 1] [--json out.json]``
(``--parallel N`` runs N jobs at once, each on its own port and TMPDIR: more load, same counts.)
Exit code: 0 when every run exited 0 with a complete checkpoint and nothing was left behind, else 1.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

COMBOS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]

TRAIN = textwrap.dedent(
    """
    import argparse, os, torch
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--peer", default="dscore")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--offload", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.peer == "deepspeed":
        import deepspeed as api
    else:
        import dscore as api
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    zero = {"stage": a.stage}
    if a.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = api.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    for _ in range(a.steps):
        loss = engine(torch.randn(2, 8, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(a.out)
    """
)


def classify(code: int, stderr: str, timed_out: bool) -> str:
    """The cause of a non-zero exit, from the launcher's exit code and the job's stderr."""
    if timed_out:
        return "timeout"
    if code == 134 or "terminate called" in stderr or "SIGABRT" in stderr:
        return "abort"
    if "EADDRINUSE" in stderr or "already in use" in stderr:
        return "port_busy"
    found = re.findall(r"^(?:\[rank\d+\]: )?(\w+(?:\.\w+)*(?:Error|Exception|Interrupt))\b", stderr, re.M)
    if found:
        return f"exception: {found[-1]}"
    return f"exit {code}"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def orphaned(names: set[str]) -> set[str]:
    """Those of ``names`` (in /dev/shm) that still exist and that no live process maps or holds open.

    /dev/shm is machine-wide: a file another program created during the run and still uses is not
    this run's leak; one nobody holds any more is (the run's processes are all gone by now)."""
    left = {n for n in names if os.path.exists(f"/dev/shm/{n}")}
    if not left:
        return set()
    held: set[str] = set()
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as fh:
                held |= {n for n in left if f"/dev/shm/{n}" in fh.read()}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):])
        except OSError:
            continue
    return left - held


def command(peer: str, python: str, script: Path, port: int | None) -> list[str]:
    if peer == "deepspeed":
        port = port or random.randint(20000, 59999)
        return [python, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), str(script)]
    cmd = [python, "-m", "dscore", "run", "--num_gpus", "2"]
    if port is not None:
        cmd += ["--master_port", str(port)]
    return [*cmd, str(script)]


def _is_cache(rel: Path) -> bool:
    return rel.parts[0].startswith("torchinductor_")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--peer", choices=["dscore", "deepspeed"], default="dscore")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as a hang")
    ap.add_argument("--free_ports", action="store_true", help="let the launcher pick the port (dscore only)")
    ap.add_argument("--json", default="", help="write the per-run records and the summary here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--parallel", type=int, default=1, help="jobs at once (each with its own port and TMPDIR)")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the runs (e.g. a venv with DeepSpeed)")
    args = ap.parse_args()

    if args.peer == "deepspeed":
        probe = subprocess.run([args.python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            print(f"soak: --peer deepspeed skipped: DeepSpeed is not importable by {args.python} ({last}); "
                  "install the bench extra (pip install -e '.[bench]') or pass --python of a venv that has it")
            return 0
        if "+dscore" in probe.stdout:  # compat/deepspeed: dscore itself under DeepSpeed's name, not a peer
            print(f"soak: --peer deepspeed skipped: `deepspeed` in {args.python} is dscore's compatibility layer "
                  f"({probe.stdout.strip()}); pass --python of a venv with DeepSpeed")
            return 0
        print(f"soak: peer DeepSpeed {probe.stdout.strip()} ({args.python})", flush=True)

    work = Path(tempfile.mkdtemp(prefix="dscore-soak-"))
    script = work / "train.py"
    script.write_text(TRAIN)
    causes: collections.Counter[str] = collections.Counter()
    records = []
    shm_left: set[str] = set()
    shm_foreign: set[str] = set()
    tmp_left = 0
    incomplete = 0
    t_start = time.perf_counter()
    lock = threading.Lock()

    def run_one(i: int) -> None:
        nonlocal tmp_left, incomplete
        stage, offload = COMBOS[i % len(COMBOS)]
        run_dir = work / f"run{i}"
        tmp = run_dir / "tmp"
        tmp.mkdir(parents=True)
        out = run_dir / "ckpt"
        port = None if args.free_ports and args.peer == "dscore" else random.randint(20000, 59999)
        cmd = [*command(args.peer, args.python, script, port), "--peer", args.peer, "--stage", str(stage),
               "--offload", str(int(offload)), "--steps", str(args.steps), "--out", str(out)]
        env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
        shm_before = shm_entries()
        t0 = time.perf_counter()
        timed_out = False
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            code, stderr = res.returncode, res.stderr
        except subprocess.TimeoutExpired as exc:
            raw = exc.stderr or ""
            code, stderr, timed_out = -1, raw.decode(errors="replace") if isinstance(raw, bytes) else raw, True
        seconds = time.perf_counter() - t0
        new_shm = orphaned(shm_entries() - shm_before)
        # Python multiprocessing's / joblib loky's semaphores: neither dscore's launcher nor its ranks use
        # them (dscore.testing aside), so on a shared machine these are other programs'
        foreign = {n for n in new_shm if n.startswith(("sem.mp-", "sem.loky-"))} if args.peer == "dscore" else set()
        new_shm -= foreign
        # torch's compile cache (torchinductor_<user>) is a cache kept on purpose, not a leak
        left = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not _is_cache(p.relative_to(tmp)))
        complete = (out / "latest").is_file()
        cause = "ok" if code == 0 and not timed_out else classify(code, stderr, timed_out)
        if cause == "ok" and not complete:
            cause = "no checkpoint"
        record = {"run": i, "stage": stage, "offload": offload, "port": port, "code": code, "cause": cause,
                  "seconds": round(seconds, 2), "shm_new": sorted(new_shm), "tmp_left": left}
        if cause != "ok":
            record["stderr_tail"] = stderr[-2000:]
        shutil.rmtree(run_dir, ignore_errors=True)
        with lock:
            shm_foreign.update(foreign)
            shm_left.update(new_shm)
            tmp_left += len(left)
            incomplete += 0 if complete else 1
            if cause != "ok":
                causes[cause] += 1
            records.append(record)
            if not args.quiet:
                print(f"run {i + 1}/{args.runs} stage {stage} offload {int(offload)}: {cause} ({seconds:.1f} s)"
                      + (f" shm+{len(new_shm)}" if new_shm else "") + (f" tmp+{len(left)}" if left else ""),
                      flush=True)
            if args.json:  # kept current, so an interrupted soak still leaves its counts
                Path(args.json).write_text(json.dumps({"causes": dict(causes), "runs": records}, indent=1))

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            for future in [pool.submit(run_one, i) for i in range(args.runs)]:
                future.result()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    records.sort(key=lambda r: r["run"])
    failures = sum(causes.values())
    summary = {
        "peer": args.peer, "runs": len(records), "nonzero_or_incomplete": failures, "by_cause": dict(causes),
        "checkpoints_incomplete": incomplete, "dev_shm_left": sorted(shm_left), "tmpdir_files_left": tmp_left,
        "dev_shm_foreign_semaphores": len(shm_foreign),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": records}, indent=2))
    return 0 if failures == 0 and not shm_left and tmp_left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
