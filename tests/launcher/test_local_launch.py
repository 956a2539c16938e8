"""Real processes: local launch, --no_ssh nodes, failure/signal/orphan handling, the per-node launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from launcher_helpers import (
    TRAIN,
    WORKER,
    alive,
    dscore_cmd,
    free_port,
    launcher_env,
    read_ranks,
    wait_for_files,
)

HANG_GUARD_S = 120


def run_launcher(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        dscore_cmd(*args), env=env or launcher_env(), cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def start_launcher(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(dscore_cmd(*args), env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def all_job_pids(records: list[dict]) -> list[int]:
    return [r["pid"] for r in records] + [c for r in records for c in r["children"]]


@pytest.mark.slow
def test_two_cpu_ranks_train_with_gloo(tmp_path: Path) -> None:
    port = str(free_port())
    res = run_launcher(
        "--num_gpus", "2", "--master_port", port, TRAIN, "--out", str(tmp_path), "two words", "--steps=3"
    )
    assert res.returncode == 0, res.stderr
    ranks = read_ranks(tmp_path, 2)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    assert ranks[0]["params"] == ranks[1]["params"]
    for lr, r in enumerate(ranks):
        assert r["argv"][1:] == [f"--local_rank={lr}", "--out", str(tmp_path), "two words", "--steps=3"]


@pytest.mark.slow
def test_two_no_ssh_nodes_form_one_world(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    common = ["-H", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1", "--master_port", port]
    procs = [
        subprocess.Popen(
            dscore_cmd(*common, "--node_rank", str(n), TRAIN, "--out", str(out)),
            env=launcher_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for n in (0, 1)
    ]
    outputs = [p.communicate(timeout=HANG_GUARD_S)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    ranks = read_ranks(out, 2)
    assert [(r["rank"], r["world"], r["cross_rank"]) for r in ranks] == [(0, 2, "0"), (1, 2, "1")]
    assert ranks[0]["params"] == ranks[1]["params"]


@pytest.mark.slow
def test_rank_failing_while_other_waits_in_barrier_ends_job(tmp_path: Path) -> None:
    proc = start_launcher(
        "--num_gpus", "2", "--master_port", str(free_port()), TRAIN, "--out", str(tmp_path), "--fail_rank", "1"
    )
    wait_for_files([tmp_path / "failed"], timeout=HANG_GUARD_S)
    out = proc.communicate(timeout=10)[0].decode()  # the job must be gone within 10 s of the failure
    assert proc.returncode == 1, out
    assert "rank 1" in out and "exited with code 1" in out


def test_failure_terminates_other_ranks_and_returns_first_code(tmp_path: Path) -> None:
    res = run_launcher("--num_gpus", "3", WORKER, "fail", str(tmp_path))
    assert res.returncode == 3, res.stderr
    assert "rank 1" in res.stderr and "exited with code 3" in res.stderr
    assert alive(all_job_pids(read_ranks(tmp_path, 3))) == []


def test_rank_killed_by_signal_gives_128_plus_signal(tmp_path: Path) -> None:
    res = run_launcher("--num_gpus", "2", WORKER, "selfkill", str(tmp_path))
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "rank 1" in res.stderr and "SIGKILL" in res.stderr
    assert alive(all_job_pids(read_ranks(tmp_path, 2))) == []


def test_ranks_ignoring_sigterm_are_killed_after_grace(tmp_path: Path) -> None:
    res = run_launcher("--num_gpus", "2", WORKER, "stubborn", str(tmp_path))
    assert res.returncode == 3, res.stderr
    assert "sending SIGKILL" in res.stderr
    assert alive(all_job_pids(read_ranks(tmp_path, 2))) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_whole_job_including_grandchildren(tmp_path: Path, sig: signal.Signals) -> None:
    proc = start_launcher("--num_gpus", "2", WORKER, "hold", str(tmp_path))
    wait_for_files([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    records = read_ranks(tmp_path, 2)
    pids = all_job_pids(records)
    assert len(alive(pids)) == 6
    proc.send_signal(sig)
    out = proc.communicate(timeout=HANG_GUARD_S)[0].decode()
    assert proc.returncode == 128 + sig, out
    assert alive(pids) == [], f"survivors: {alive(pids)}\n{out}"


def test_launcher_killed_with_sigkill_takes_ranks_along(tmp_path: Path) -> None:
    proc = start_launcher("--num_gpus", "2", WORKER, "hold", str(tmp_path))
    wait_for_files([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    ranks = [r["pid"] for r in read_ranks(tmp_path, 2)]
    proc.kill()
    proc.wait(timeout=HANG_GUARD_S)
    import psutil

    for pid in ranks:  # PR_SET_PDEATHSIG: the ranks die with the launcher
        try:
            psutil.Process(pid).wait(timeout=10)
        except psutil.NoSuchProcess:
            pass
    assert alive(ranks) == []
    # grandchildren are orphans now (no subreaper left); clean them up for the next tests
    for r in read_ranks(tmp_path, 2):
        for pid in alive(r["children"]):
            os.kill(pid, signal.SIGKILL)


def test_save_pid_each_rank_log_and_nothing_left_behind(tmp_path: Path) -> None:
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    logs = tmp_path / "logs"
    proc = start_launcher(
        "--num_gpus", "2", "--save_pid", "--enable_each_rank_log", str(logs), WORKER, "hold", str(tmp_path)
    )
    wait_for_files([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    pid_file = Path(tempfile.gettempdir()) / f"{proc.pid}.deepspeed"
    assert pid_file.read_text().strip() == str(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=HANG_GUARD_S)
    assert not pid_file.exists()
    assert sorted(p.name.split("_")[-1] for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # Other engineers' tests on this shared machine create multiprocessing semaphores (sem.mp-*)
    # concurrently; neither the launcher nor this torch-free job uses multiprocessing.
    assert {f for f in shm_after - shm_before if not f.startswith("sem.mp-")} == set()


def test_argv_and_env_reach_each_rank_unchanged(tmp_path: Path) -> None:
    args = ["echo", str(tmp_path), "a b", "--flag=x y", "", "$HOME", "--num_gpus", "7"]
    res = run_launcher("--num_gpus", "2", "--master_port", "29999", WORKER, *args)
    assert res.returncode == 0, res.stderr
    for lr, r in enumerate(read_ranks(tmp_path, 2)):
        assert r["argv"][1:] == [f"--local_rank={lr}", *args]
        env = r["env"]
        assert env["RANK"] == str(lr) and env["LOCAL_RANK"] == str(lr) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_SIZE"] == "2" and env["CROSS_RANK"] == "0" and env["CROSS_SIZE"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29999"


def test_no_local_rank_and_no_python(tmp_path: Path) -> None:
    res = run_launcher("--num_gpus", "1", "--no_local_rank", WORKER, "echo", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert read_ranks(tmp_path, 1)[0]["argv"][1:] == ["echo", str(tmp_path)]
    script = tmp_path / "prog.sh"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {WORKER} "$@"\n')
    script.chmod(0o755)
    out2 = tmp_path / "np"
    out2.mkdir()
    res = run_launcher("--num_gpus", "1", "--no_python", "--no_local_rank", str(script), "echo", str(out2))
    assert res.returncode == 0, res.stderr
    assert read_ranks(out2, 1)[0]["argv"][1:] == ["echo", str(out2)]


def test_node_launcher_stops_ranks_when_stdin_closes(tmp_path: Path) -> None:
    from dscore.launcher.node import encode_world_info

    argv = [sys.executable, "-m", "dscore.launcher.node", f"--world_info={encode_world_info({'h': [0, 1]})}"]
    argv += ["--node_rank=0", "--master_addr=127.0.0.1", "--stdin_watchdog", WORKER, "hold", str(tmp_path)]
    proc = subprocess.Popen(
        argv, env=launcher_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    wait_for_files([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    pids = all_job_pids(read_ranks(tmp_path, 2))
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=HANG_GUARD_S)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stdin EOF" in out
    assert alive(pids) == []


def test_mpi_mode_maps_mpi_rank_variables(tmp_path: Path) -> None:
    env = launcher_env(
        OMPI_COMM_WORLD_RANK="1",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    argv = [
        sys.executable,
        "-m",
        "dscore.launcher.node",
        "--mpi",
        "--master_addr=10.0.0.1",
        "--master_port=1234",
        WORKER,
        "echo",
        str(tmp_path),
    ]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "rank1.json").read_text())
    assert rec["argv"][1:] == ["echo", str(tmp_path)]  # MPI-style: no --local_rank
    assert {
        k: rec["env"][k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
