"""Every multi-node back end runs a real job on the fixture's nodes (see ``cluster.py``).

For ``--launcher pdsh``, ``ssh``, ``openmpi``, ``mpich``, ``slurm`` and ``--no_ssh`` (one ``dscore run
--node_rank R`` started on each node): 2 nodes x 1 slot train ``mn_train.py`` (ZeRO stage 2, 3 steps);
losses and final parameters equal the same job run as 2 local ranks; what each process saw (rank, local
rank, world size, master address, its own node address, argv, exported variables) is asserted from the
rank's own record. The hostfile has three nodes and each back end gets a different selection option
(``--num_nodes``, ``--exclude``, ``--include``, ``--num_gpus``), so an ignored option shows up as a
wrong world. Then a rank on node 2 fails (raises or is SIGKILLed) and every rank on every node must
stop and ``dscore run`` exit with that rank's code; and SIGTERM to ``dscore run`` must stop every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import Cluster, free_port

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "mn_train.py")
BACKENDS = ["pdsh", "ssh", "openmpi", "mpich", "slurm", "no_ssh"]
TAG = "two words  and 'quotes'"
#: exit code of a rank that raised (Python) / was SIGKILLed
RAISED, KILLED = 1, 128 + signal.SIGKILL
#: how each back end's job fails in the failure test (both kinds covered, each back end once)
FAIL_HOW = {"pdsh": "kill", "ssh": "raise", "openmpi": "kill", "mpich": "raise", "slurm": "raise", "no_ssh": "kill"}


def dscore(*args: str) -> list[str]:
    return [sys.executable, "-m", "dscore", "run", *args]


def selection(cluster: Cluster, backend: str) -> list[str]:
    """Options choosing the first two nodes with one slot each out of the 3-node hostfile (1, 1, 2 slots)."""
    n3 = cluster.nodes[2].name if backend == "slurm" else cluster.nodes[2].addr
    n1, n2 = ((n.name if backend == "slurm" else n.addr) for n in cluster.nodes[:2])
    return {
        "pdsh": ["--num_nodes", "2"],
        "ssh": ["--exclude", n3],
        "openmpi": ["--include", f"{n1}@{n2}"],
        "mpich": ["--num_nodes", "2", "--num_gpus", "1"],
        "slurm": ["--exclude", n3],
        "no_ssh": ["--num_nodes", "2"],
    }[backend]


def backend_args(cluster: Cluster, backend: str) -> list[str]:
    """Per back end options this machine needs (and the ones under test: --ssh_port, --venv_script)."""
    n1 = cluster.nodes[0].addr
    if backend in ("pdsh", "ssh"):
        return ["--launcher", backend, "--ssh_port", str(cluster.ssh_port)]
    port = ["--ssh_port", str(cluster.ssh_port)]
    if backend == "openmpi":
        return ["--launcher", "openmpi", *port, "--launcher_args", f"--mca btl_tcp_if_include {cluster.iface}"]
    if backend == "mpich":  # hydra's proxies must reach the launching host on the test network
        return ["--launcher", "mpich", *port, "--launcher_args", f"-localhost {cluster.gateway}"]
    if backend == "slurm":  # Slurm node names do not resolve: give rank 0's address
        return ["--launcher", "slurm", "--master_addr", n1]
    raise AssertionError(backend)


class Job:
    """Files of one job: hostfile, .deepspeed_env, venv script, output dir, marker for injection."""

    def __init__(self, cluster: Cluster, tmp: Path, backend: str) -> None:
        self.cluster, self.backend, self.dir = cluster, backend, tmp
        self.out = tmp / "out"
        self.out.mkdir()
        self.pwned = tmp / "pwned"
        self.hostfile = cluster.hostfile(tmp / "hostfile", [1, 1, 2], names=backend == "slurm")
        self.env_file = tmp / "deepspeed_env"
        self.env_file.write_text(
            "\n".join([
                f"GLOO_SOCKET_IFNAME={cluster.iface}",
                "MN_SPACES=two words  here",
                "MN_EQ=k=v=w",
                "MN_QUOTES=\"dq\" 'sq' \\back ${X:-d} $",
                "MN_LIB=/opt/efa/lib:$HOME",
                "MN_BRACED=${HOME}/x y",
                f"MN_INJECT=a; touch {self.pwned}",
                f"MN_SUBST=$(touch {self.pwned})`touch {self.pwned}`$HOME",
            ]) + "\n"
        )  # fmt: skip
        self.venv_script = tmp / "activate.sh"
        self.venv_script.write_text("export VENV_SCRIPT_RAN=yes\n")
        self.home = tmp / "launcher-home"  # differs from the nodes' HOME (sshd gives /root)
        self.home.mkdir()

    def env(self) -> dict[str, str]:
        return self.cluster.env(
            DS_ENV_FILE=str(self.env_file),
            NCCL_MN_TEST="nccl; $(x) v",
            PYTHONMN_TEST="py value",
            HOME=str(self.home),
            GLOO_SOCKET_IFNAME=self.cluster.iface,  # for --no_ssh (nothing is exported there)
        )

    def argv(self, *script_args: str, port: int) -> list[str]:
        return dscore(
            "-H", str(self.hostfile), *selection(self.cluster, self.backend), *backend_args(self.cluster, self.backend),
            "--venv_script", str(self.venv_script), "--master_port", str(port),
            TRAIN, "--out", str(self.out), "--tag", TAG, *script_args,
        )  # fmt: skip

    def start(self, *script_args: str) -> list[subprocess.Popen[bytes]]:
        port = free_port()
        if self.backend != "no_ssh":
            return [self._popen(self.argv(*script_args, port=port), [])]
        procs = []
        for rank, node in enumerate(self.cluster.nodes[:2]):
            argv = dscore(
                "-H", str(self.hostfile), *selection(self.cluster, "no_ssh"), "--no_ssh", "--node_rank", str(rank),
                "--master_addr", self.cluster.nodes[0].addr, "--master_port", str(port),
                TRAIN, "--out", str(self.out), "--tag", TAG, *script_args,
            )  # fmt: skip
            procs.append(self._popen(argv, node.enter()))
        return procs

    def _popen(self, argv: list[str], prefix: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*prefix, *argv], env=self.env(), cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def ranks_alive(self) -> list[str]:
        """Processes of this job still running anywhere on the machine (every node's PID namespace)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if str(self.out) in cmd and "mn_train.py" in cmd and state != "Z" and "dscore run" not in cmd:
                found.append(f"{entry.name}: {cmd[:200]}")
        return found


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> tuple[list[int], str, float]:
    start = time.monotonic()
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, _ = proc.communicate()
            pytest.fail(f"job still running after {timeout} s:\n{out.decode(errors='replace')[-6000:]}")
        outs.append(out.decode(errors="replace"))
    return [p.returncode for p in procs], "\n".join(outs), time.monotonic() - start


def wait_until_gone(job: Job, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = job.ranks_alive()
        if not left:
            return []
        time.sleep(0.2)
    return job.ranks_alive()


# ------------------------------------------------------------------------------------------ reference
@pytest.fixture(scope="session")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same training as 2 local ranks (``dscore run --num_gpus 2``)."""
    out = tmp_path_factory.mktemp("reference")
    res = subprocess.run(
        dscore("--num_gpus", "2", "--master_port", str(free_port()), TRAIN, "--out", str(out)),
        env=cluster.env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_trains_like_local_ranks(cluster: Cluster, reference: list[dict], tmp_path: Path, backend: str) -> None:
    job = Job(cluster, tmp_path, backend)
    codes, out, took = wait_all(job.start(), timeout=240)
    print(f"[{cluster.mode}] {backend}: job took {took:.1f} s")
    assert codes == [0] * len(codes), out[-6000:]
    if backend in ("openmpi", "mpich"):
        program = "mpirun.openmpi" if backend == "openmpi" else "mpiexec.hydra"
        assert f"--launcher {backend}: starting the job with " in out and program in out, out[-3000:]
    ranks = [json.loads((job.out / f"rank{r}.json").read_text()) for r in range(2)]
    n1, n2 = cluster.nodes[0].addr, cluster.nodes[1].addr
    for r, rec in enumerate(ranks):
        env = rec["env_before"]
        assert (rec["rank"], rec["world"], rec["engine_local_rank"]) == (r, 2, 0)
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(r), "0", "2"), env
        assert env["MASTER_ADDR"] == n1
        assert rec["env_after"]["LOCAL_RANK"] == "0"
        if cluster.mode == "netns":  # each rank really ran on its own node
            assert rec["addrs"] == [(n1, n2)[r]], rec["addrs"]
        assert rec["argv"][rec["argv"].index("--tag") + 1] == TAG  # one argument, spaces and quotes intact
        assert rec["tag"] == TAG
    # numerics: identical to the same job as two local ranks
    for got, ref in zip(ranks, reference, strict=True):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
        assert got["params"] == pytest.approx(ref["params"], rel=1e-6, abs=1e-7)
    assert ranks[0]["params"] == ranks[1]["params"]
    if backend == "no_ssh":
        return
    # what crosses the wire
    for rec in ranks:
        env = rec["env_before"]
        home = env["HOME"]
        assert env["NCCL_MN_TEST"] == "nccl; $(x) v" and env["PYTHONMN_TEST"] == "py value"
        assert env["VENV_SCRIPT_RAN"] == "yes"
        assert env["MN_SPACES"] == "two words  here" and env["MN_EQ"] == "k=v=w"
        assert env["MN_QUOTES"] == "\"dq\" 'sq' \\back ${X:-d} $"
        assert env["MN_LIB"] == f"/opt/efa/lib:{home}"  # $NAME expanded on the node
        assert env["MN_BRACED"] == f"{home}/x y"
        assert env["MN_INJECT"] == f"a; touch {job.pwned}"
        assert env["MN_SUBST"] == f"$(touch {job.pwned})`touch {job.pwned}`{home}"
        if backend in ("pdsh", "ssh", "openmpi"):  # the node's own HOME (sshd's), not the launcher's
            assert home != str(job.home)
    assert not job.pwned.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_remote_rank_failure_stops_every_node(cluster: Cluster, tmp_path: Path, backend: str) -> None:
    how = FAIL_HOW[backend]
    job = Job(cluster, tmp_path, backend)
    survivors = "barrier" if backend == "no_ssh" else "sleep"  # no_ssh: nodes only know each other through gloo
    procs = job.start("--fail_rank", "1", "--fail_how", how, "--survivors", survivors)
    codes, out, took = wait_all(procs, timeout=120)  # the other rank sleeps 600 s: only the launcher ends it
    ended = time.time()
    # rank 1 fails 1 s after writing pid1: how long the whole job took to stop after that (reported, not timed)
    stop_s = ended - ((job.out / "pid1").stat().st_mtime + 1.0) if (job.out / "pid1").exists() else float("nan")
    print(f"[{cluster.mode}] {backend}: rank 1 ({how}) -> dscore run exited {codes} after {took:.1f} s, "
          f"{stop_s:.1f} s after the failure")  # fmt: skip
    expected = KILLED if how == "kill" else RAISED
    if backend == "no_ssh":
        # node 1's launcher ends because its rank's collective fails; node 2's with rank 1's code
        assert codes[1] == expected and codes[0] != 0, out[-4000:]
    else:
        assert codes == [expected], out[-6000:]
    assert (job.out / "pid0").exists() and (job.out / "pid1").exists()
    if how == "raise":
        assert "injected failure on rank 1" in out
    assert not wait_until_gone(job), job.ranks_alive()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "no_ssh"])
def test_sigterm_to_dscore_run_stops_every_rank(cluster: Cluster, tmp_path: Path, backend: str) -> None:
    job = Job(cluster, tmp_path, backend)
    (proc,) = job.start("--hold")
    deadline = time.monotonic() + 120
    while not ((job.out / "pid0").exists() and (job.out / "pid1").exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0].decode(errors="replace")
            pytest.fail(f"job ended ({proc.returncode}) before both ranks started:\n{out[-5000:]}")
        time.sleep(0.1)
    assert len(job.ranks_alive()) >= 2
    proc.send_signal(signal.SIGTERM)
    codes, out, took = wait_all([proc], timeout=90)
    print(f"[{cluster.mode}] {backend}: SIGTERM -> dscore run exited {codes[0]} after {took:.1f} s")
    assert codes[0] != 0, out[-3000:]
    assert not wait_until_gone(job), job.ranks_alive()


@pytest.mark.parametrize("backend", ["openmpi", "mpich", "slurm"])
def test_slot_filters_are_refused_by_count_based_backends(cluster: Cluster, tmp_path: Path, backend: str) -> None:
    """mpirun/srun place ranks by count: a filter picking particular slots is refused before anything starts
    (in-process: the same plan ``dscore run`` builds)."""
    import argparse

    from dscore.errors import LauncherError
    from dscore.launcher.options import add_arguments
    from dscore.launcher.plan import build_plan

    job = Job(cluster, tmp_path, backend)
    n1, n3 = (cluster.nodes[i].name if backend == "slurm" else cluster.nodes[i].addr for i in (0, 2))
    argv = [a for a in job.argv(port=free_port())[4:] if a not in selection(cluster, backend)]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(["--include", f"{n1}@{n3}:1", *argv])
    with pytest.raises(LauncherError, match=f"--launcher {backend} places ranks by count and cannot honour "
                       f"slot-specific --include '{n1}@{n3}:1'"):  # fmt: skip
        build_plan(args, environ=job.env(), cwd=str(tmp_path))
