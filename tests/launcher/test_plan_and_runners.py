"""Launch plans (``--dry_run``) and the remote commands of every runner."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_helpers import WORKER, dscore_cmd, launcher_env, read_ranks

from dscore.errors import AcceleratorError, HostfileError, LauncherError
from dscore.launcher.accel import AcceleratorLaunchInfo, cpu_launch_info
from dscore.launcher.node import decode_world_info, encode_world_info, mpi_rank_env
from dscore.launcher.options import add_arguments
from dscore.launcher.plan import build_plan
from dscore.launcher.runners import RUNNERS

CUDA = AcceleratorLaunchInfo(name="cuda", visible_devices_vars=("CUDA_VISIBLE_DEVICES",), export_prefixes=("NCCL",))
PY = sys.executable


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def hostfile(tmp_path: Path) -> str:
    path = tmp_path / "hostfile"
    path.write_text("# rack\nworker-0 slots=2\nworker-1 slots=2  # spare\n")
    return str(path)


@pytest.fixture(autouse=True)
def _no_mpi_programs(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Plans name the generic program (``mpirun``) whatever this machine has installed; the per-flavour
    lookup is tested in :func:`test_mpi_program_lookup` with a PATH of its own."""
    if request.node.name != "test_mpi_program_lookup":
        import dscore.launcher.runners as runners

        monkeypatch.setattr(runners, "_which", lambda name: None)


def plan(*argv: str, accel: AcceleratorLaunchInfo = CUDA, environ: dict[str, str] | None = None, cwd: str = "/proj"):
    return build_plan(parse(*argv), environ=environ or {}, cwd=cwd, accel=accel)


# ----------------------------------------------------------------------------------------- local plans
def test_local_plan_ranks_env_and_argv() -> None:
    p = plan("--num_gpus", "2", "--master_port", "1234", "train.py", "--lr", "0.1 0.2")
    assert p.runner == "local" and p.world_info == {"localhost": [0, 1]}
    assert [(q.host, q.rank, q.local_rank) for q in p.processes] == [("localhost", 0, 0), ("localhost", 1, 1)]
    assert p.processes[1].env == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2)),
    }
    assert p.processes[1].argv == [PY, "-u", "train.py", "--local_rank=1", "--lr", "0.1 0.2"]
    assert plan("--num_gpus", "1", "--module", "pkg.train").processes[0].argv == [
        PY,
        "-u",
        "-m",
        "pkg.train",
        "--local_rank=0",
    ]


def test_visible_devices_variable_becomes_include_and_is_reset() -> None:
    p = plan("train.py", environ={"CUDA_VISIBLE_DEVICES": "1,3"})
    assert p.world_info == {"localhost": [1, 3]}
    assert [q.env["CUDA_VISIBLE_DEVICES"] for q in p.processes] == ["1,3", "1,3"]
    assert p.processes[0].unset == ("CUDA_VISIBLE_DEVICES",)
    # with --num_gpus the slots index the visible list (issue 33 item 6; DeepSpeed would take device 0)
    p = plan("--num_gpus", "1", "train.py", environ={"CUDA_VISIBLE_DEVICES": "1,3"})
    assert p.world_info == {"localhost": [1]}


def test_cpu_fallback_has_no_visible_devices_variable() -> None:
    p = plan("--nproc_per_node", "3", "train.py", accel=cpu_launch_info("test"))
    assert p.world_info == {"localhost": [0, 1, 2]}
    assert all("CUDA_VISIBLE_DEVICES" not in q.env for q in p.processes)


def test_single_host_hostfile_with_include_launches_locally(hostfile: str) -> None:
    p = plan("-H", hostfile, "-i", "worker-1:1", "train.py")
    assert p.runner == "local" and p.world_info == {"worker-1": [1]}
    assert p.processes[0].env["CUDA_VISIBLE_DEVICES"] == "1"


def test_no_ssh_starts_only_this_nodes_ranks(hostfile: str) -> None:
    p = plan("-H", hostfile, "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", "train.py")
    assert p.runner == "no_ssh"
    assert [(q.host, q.rank, q.local_rank, q.env["CROSS_RANK"]) for q in p.processes] == [
        ("worker-1", 2, 0, "1"),
        ("worker-1", 3, 1, "1"),
    ]
    assert {q.env["WORLD_SIZE"] for q in p.processes} == {"4"}
    p = plan("--no_ssh", "--num_nodes", "2", "--num_gpus", "1", "--node_rank", "1", "--master_addr", "a", "t.py")
    assert [(q.rank, q.env["WORLD_SIZE"]) for q in p.processes] == [(1, "2")]


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--no_ssh", "--master_addr", "a"], r"--no_ssh needs --node_rank in 0..1 .* got -1"),
        (["--no_ssh", "--node_rank", "2", "--master_addr", "a"], r"--node_rank in 0..1"),
        (["--no_ssh", "--node_rank", "0"], r"--no_ssh needs --master_addr"),
        (["--no_ssh", "--node_rank", "0", "--master_addr", ""], r"--no_ssh needs --master_addr"),
        (["--node_rank", "0"], r"only used with --no_ssh"),
        (["--launcher", "mpi"], r"--launcher 'mpi' is not a known launcher; choose one of pdsh, ssh, openmpi"),
        (["--module", "--no_python"], r"cannot be used together"),
        (["-i", "worker-0", "--num_gpus", "1"], r"cannot be combined with --num_gpus 1"),
        (["-i", "worker-0:7"], r"host 'worker-0' has no slot 7; valid slots: 0,1"),
        (["--json"], r"--json only applies to --dry_run"),
    ],
)
def test_option_errors(hostfile: str, argv: list[str], pattern: str) -> None:
    with pytest.raises(LauncherError, match=pattern):
        plan("-H", hostfile, *argv, "train.py")


def test_num_nodes_without_hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_HOSTFILE", str(tmp_path / "none"))
    with pytest.raises(LauncherError, match="needs a hostfile"):
        plan("--num_nodes", "2", "train.py")


def test_requested_accelerator_that_is_not_installed_is_not_replaced_by_cpu() -> None:
    pytest.importorskip("dscore.accelerator")
    from dscore.launcher.accel import resolve_launch_info

    with pytest.raises(AcceleratorError, match="DS_ACCELERATOR='nosuch'"):
        resolve_launch_info({"DS_ACCELERATOR": "nosuch"})


# ----------------------------------------------------------------------------------------- runners
def multi(runner: str, hostfile: str, *extra: str, environ: dict[str, str] | None = None):
    environ = {"NCCL_DEBUG": "INFO", "UCX_TLS": "rc", "HOME": "/nonexistent"} if environ is None else environ
    return plan(
        "-H",
        hostfile,
        "--launcher",
        runner,
        "--master_addr",
        "10.0.0.1",
        *extra,
        "train.py",
        "a b",
        "--x=1",
        environ=environ,
    )


def test_world_info_encoding_matches_deepspeed() -> None:
    assert encode_world_info({"localhost": [0, 1]}) == "eyJsb2NhbGhvc3QiOiBbMCwgMV19"
    assert decode_world_info("eyJsb2NhbGhvc3QiOiBbMCwgMV19") == {"localhost": [0, 1]}
    with pytest.raises(LauncherError, match="--world_info"):
        decode_world_info("not-base64!")


def node_tail(world: dict, node_rank: str) -> list[str]:
    return [
        PY,
        "-u",
        "-m",
        "dscore.launcher.node",
        f"--world_info={encode_world_info(world)}",
        f"--node_rank={node_rank}",
        "--master_addr=10.0.0.1",
        "--master_port=29500",
        "--visible_devices_env=CUDA_VISIBLE_DEVICES",
    ]


def test_pdsh_command(hostfile: str) -> None:
    p = multi("pdsh", hostfile, "--launcher_args", "-R ssh", "--ssh_port", "2222")
    (cmd,) = p.commands
    assert cmd.argv[:8] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh"]
    assert cmd.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    world = {"worker-0": [0, 1], "worker-1": [0, 1]}
    assert cmd.argv[8] == (
        "export NCCL_DEBUG=INFO; export UCX_TLS=rc; export PYTHONPATH=/proj; cd /proj; "
        + shlex.join(node_tail(world, "%n") + ["train.py", "a b", "--x=1"])
    )
    cleanup = p.cleanup[0]
    # same rcmd type and ssh port as the job (the clean-up used to ignore --ssh_port), and a pattern that
    # cannot match the clean-up command itself
    assert cleanup[:3] == ["env", "PDSH_RCMD_TYPE=ssh", "PDSH_SSH_ARGS_APPEND=-p 2222"]
    assert cleanup[3:8] == ["pdsh", "-f", "1024", "-w", "worker-0,worker-1"]
    assert cleanup[-3:-1] == ["-R", "ssh"]
    assert cleanup[-1] == f"pkill -f '[d]score.launcher.node --world_info={encode_world_info(world)}'"
    assert cmd.watch is not None
    assert [(q.host, q.rank, q.local_rank) for q in p.processes] == [
        ("worker-0", 0, 0),
        ("worker-0", 1, 1),
        ("worker-1", 2, 0),
        ("worker-1", 3, 1),
    ]
    assert p.processes[2].argv == [PY, "-u", "train.py", "--local_rank=0", "a b", "--x=1"]


def test_ssh_command_per_host_with_user_and_filters(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.write_text("alice@w0 slots=4\nw1 slots=4\nw2 slots=4\n")
    p = multi("ssh", str(hf), "-e", "w1@w2:0,1", "--venv_script", "/opt/my env/activate")
    assert p.world_info == {"w0": [0, 1, 2, 3], "w2": [2, 3]}
    assert [c.argv[:4] for c in p.commands] == [
        ["ssh", "-o", "BatchMode=yes", "alice@w0"],
        ["ssh", "-o", "BatchMode=yes", "w2"],
    ]
    remote = p.commands[1].argv[4]
    assert "source '/opt/my env/activate';" in remote
    assert shlex.join(node_tail(p.world_info, "1") + ["--stdin_watchdog", "train.py", "a b", "--x=1"]) in remote
    assert [c.stdin for c in p.commands] == ["pipe", "pipe"]


def test_openmpi_command(hostfile: str) -> None:
    p = multi("openmpi", hostfile, "-i", "worker-1", "--force_multi")
    (cmd,) = p.commands
    assert cmd.argv == [
        "mpirun", "-n", "2", "--host", "worker-1:2", "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0",
        "-x", "UCX_TLS=tcp", "-x", "NCCL_DEBUG=INFO", "-x", "UCX_TLS=rc", "-x", "PYTHONPATH=/proj",
        PY, "-u", "-m", "dscore.launcher.node", "--mpi", "--master_addr=10.0.0.1", "--master_port=29500",
        "train.py", "a b", "--x=1",
    ]  # fmt: skip
    own = multi("openmpi", hostfile, "--launcher_args", "--mca btl_tcp_if_include ib0").commands[0].argv
    assert own.count("btl_tcp_if_include") == 1 and "ib0" in own
    port = multi("openmpi", hostfile, "--ssh_port", "2222").commands[0].argv
    assert port[port.index("plm_rsh_args") - 1 : port.index("plm_rsh_args") + 2] == ["--mca", "plm_rsh_args", "-p 2222"]
    assert all(q.argv == [PY, "-u", "train.py", "a b", "--x=1"] for q in p.processes)  # no --local_rank


def test_mpich_command(hostfile: str) -> None:
    (cmd,) = multi("mpich", hostfile, environ={"NCCL_X": "v w"}).commands
    assert cmd.argv == [
        "mpirun", "-n", "4", "-ppn", "2", "-genv", "NCCL_X", "v w", "-genv", "PYTHONPATH", "/proj",
        "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500", "-genv", "WORLD_SIZE", "4",
        "-genv", "LOCAL_SIZE", "2", "-hosts", "worker-0,worker-1",
        PY, "-u", "-m", "dscore.launcher.node", "--mpi", "--master_addr=10.0.0.1", "--master_port=29500",
        "train.py", "a b", "--x=1",
    ]  # fmt: skip


def test_ssh_port_for_hydra_and_slurm(hostfile: str) -> None:
    """--ssh_port is never silently ignored: hydra-based mpiruns get it as ssh launcher arguments, slurm refuses."""
    for runner in ("mpich", "impi", "mvapich"):
        (cmd,) = multi(runner, hostfile, "--ssh_port", "2222", environ={}).commands
        assert cmd.env == {"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222"}, runner
    with pytest.raises(LauncherError, match="--launcher slurm does not use ssh .* --ssh_port 2222"):
        multi("slurm", hostfile, "--ssh_port", "2222")


def test_impi_command(hostfile: str) -> None:
    (cmd,) = multi("impi", hostfile, environ={}).commands
    head = [
        "mpirun",
        "-ppn",
        "2",
        "-genv",
        "PYTHONPATH",
        "/proj",
        "-genv",
        "MASTER_ADDR",
        "10.0.0.1",
        "-genv",
        "MASTER_PORT",
        "29500",
        "-genv",
        "WORLD_SIZE",
        "4",
        "-genv",
        "LOCAL_SIZE",
        "2",
        "-genv",
        "I_MPI_PIN",
        "0",
        "-hosts",
        "worker-0,worker-1",
    ]
    assert cmd.argv[: len(head)] == head
    sections = " ".join(cmd.argv[len(head) :]).split(" : ")
    assert sections[3] == f"-n 1 -env RANK 3 -env LOCAL_RANK 1 {PY} -u train.py a b --x=1"
    assert len(sections) == 4


def test_mvapich_command(hostfile: str) -> None:
    (cmd,) = multi("mvapich", hostfile, environ={}).commands
    assert cmd.argv[:8] == ["mpirun", "-np", "4", "-ppn", "2", "-hosts", "worker-0,worker-1", "-env"]
    assert ["-env", "MV2_USE_CUDA", "1"] == cmd.argv[
        cmd.argv.index("MV2_USE_CUDA") - 1 : cmd.argv.index("MV2_USE_CUDA") + 2
    ]
    assert ["-env", "PYTHONPATH", "/proj"] == cmd.argv[
        cmd.argv.index("PYTHONPATH") - 1 : cmd.argv.index("PYTHONPATH") + 2
    ]
    assert cmd.argv[-5:] == ["--master_addr=10.0.0.1", "--master_port=29500", "train.py", "a b", "--x=1"]


def test_slurm_command(hostfile: str) -> None:
    (cmd,) = multi(
        "slurm", hostfile, "--launcher_args", "--comment x", environ={"NCCL_A": "--opt=1,--mode=fast"}
    ).commands
    assert cmd.argv[:13] == ["srun", "-n", "4", "--comment", "x", "--nodelist", "worker-0,worker-1", "--nodes", "2",
                             "--ntasks-per-node", "2", "--export=ALL", "--kill-on-bad-exit=1"]  # fmt: skip
    assert cmd.env == {
        "NCCL_A": "--opt=1,--mode=fast",
        "PYTHONPATH": "/proj",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }


@pytest.mark.parametrize("runner", ["openmpi", "mpich", "impi", "mvapich", "slurm"])
def test_mpi_style_runners_reject_slot_filters(hostfile: str, runner: str) -> None:
    with pytest.raises(
        LauncherError, match=rf"--launcher {runner} places ranks by count .*--include 'worker-0:1@worker-1'"
    ):
        multi(runner, hostfile, "-i", "worker-0:1@worker-1")


@pytest.mark.parametrize("runner", ["mpich", "impi", "mvapich", "slurm"])
def test_uniform_runners_reject_uneven_hosts(tmp_path: Path, runner: str) -> None:
    hf = tmp_path / "hf"
    hf.write_text("a slots=2\nb slots=1\n")
    with pytest.raises(LauncherError, match=r"same number of slots on every host, got a=2, b=1"):
        multi(runner, str(hf))


@pytest.mark.parametrize("runner", ["openmpi", "mpich", "impi", "mvapich", "slurm"])
def test_mpi_style_runners_reject_user_hosts_and_expand_on_the_node(tmp_path: Path, runner: str) -> None:
    hf = tmp_path / "hf"
    hf.write_text("u@a slots=1\nb slots=1\n")
    with pytest.raises(LauncherError, match="need an ssh-based runner"):
        multi(runner, str(hf))
    hf.write_text("a slots=1\nb slots=1\n")
    env_file = tmp_path / "env"
    env_file.write_text("LD_LIBRARY_PATH=/x:$LD_LIBRARY_PATH\nOTHER=@expand:${HOME}/y\nPLAIN=$(no)\n")
    environ = {"DS_ENV_FILE": str(env_file)}
    if runner == "impi":  # starts the script directly: nothing on the node could expand the reference
        with pytest.raises(LauncherError, match="LD_LIBRARY_PATH, OTHER contain \\$NAME references"):
            multi(runner, str(hf), environ=environ)
        return
    (cmd,) = multi(runner, str(hf), environ=environ).commands
    # the node entry expands the references on the node, in file order; $(no) is no reference
    flags = [a for a in cmd.argv if a.startswith("--expand_env")]
    assert flags == ["--expand_env=LD_LIBRARY_PATH", "--expand_env=OTHER"]


def test_mpi_program_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Open MPI and MPICH installed side by side: each runner picks its own flavour's program."""
    from dscore.launcher.runners import check_program, get_runner

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def fake(name: str, version: str) -> None:
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\necho '{version}'\n")
        path.chmod(0o755)

    monkeypatch.setenv("PATH", str(bin_dir))
    fake("mpirun", "mpirun (Open MPI) 4.1.4")
    assert get_runner("openmpi").program() == "mpirun"
    assert "(Open MPI) 4.1.4" in check_program(get_runner("openmpi"), "mpirun")
    with pytest.raises(LauncherError, match=r"--launcher mpich: .*mpirun is not mpich .*Open MPI"):
        check_program(get_runner("mpich"), "mpirun")
    fake("mpirun.openmpi", "mpirun.openmpi (Open MPI) 4.1.4")
    fake("mpiexec.hydra", "HYDRA build details:")
    assert get_runner("openmpi").program() == "mpirun.openmpi"
    assert get_runner("mpich").program() == "mpiexec.hydra"
    assert check_program(get_runner("mpich"), "mpiexec.hydra").endswith("(HYDRA build details:)")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LauncherError, match="needs one of mpiexec.hydra, mpirun.mpich, mpiexec.mpich, mpirun, none of which"):
        check_program(get_runner("mpich"), "mpirun")


def test_every_runner_is_covered() -> None:
    assert set(RUNNERS) == {"pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm"}


def test_mpi_rank_env_sources() -> None:
    assert mpi_rank_env({"PMI_RANK": "3", "MPI_LOCALRANKID": "1", "PMI_SIZE": "4"}) == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}  # fmt: skip
    assert mpi_rank_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"})["RANK"] == "5"
    with pytest.raises(LauncherError, match="disagree"):
        mpi_rank_env({"PMI_RANK": "0", "MPI_LOCALRANKID": "0", "PALS_LOCAL_RANKID": "1"})
    with pytest.raises(LauncherError, match="no rank variable"):
        mpi_rank_env({})


# ------------------------------------------------------- remote commands executed by a local shell
@pytest.mark.parametrize("runner", ["ssh", "pdsh"])
def test_remote_commands_run_through_a_real_shell_form_one_world(tmp_path: Path, runner: str) -> None:
    """No sshd/pdsh here: run each host's remote command with ``sh -c`` as sshd would."""
    hf = tmp_path / "hf"
    hf.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    env_file = tmp_path / "env"
    env_file.write_text("HELLO=two words; $(touch pwned)\nEXTRA_FLAGS=--opt=1,--mode=fast\n")
    environ = launcher_env(DS_ENV_FILE=str(env_file))
    p = plan("-H", str(hf), "--launcher", runner, WORKER, "echo", str(out), "arg with space",
             accel=cpu_launch_info("test"), environ=environ, cwd=str(tmp_path))  # fmt: skip
    assert p.master_addr == "127.0.0.1"
    remotes = [c.argv[-1] for c in p.commands] if runner == "ssh" else [
        p.commands[0].argv[-1].replace("%n", str(n)) for n in (0, 1)]  # fmt: skip
    procs = [subprocess.Popen(["sh", "-c", r], env=environ, cwd="/", stdin=subprocess.PIPE) for r in remotes]
    for proc in procs:  # stdin stays open while the job runs, as the ssh connection would
        proc.wait(timeout=120)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    assert [proc.returncode for proc in procs] == [0, 0]
    ranks = read_ranks(out, 2)
    assert [(r["env"]["RANK"], r["env"]["CROSS_RANK"], r["env"]["WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "2"), ("1", "1", "2")]  # fmt: skip
    assert all(r["argv"][1:] == ["--local_rank=0", "echo", str(out), "arg with space"] for r in ranks)
    assert {r["env"]["HELLO"] for r in ranks} == {"two words; $(touch pwned)"}
    assert {r["env"]["EXTRA_FLAGS"] for r in ranks} == {"--opt=1,--mode=fast"}
    assert not (tmp_path / "pwned").exists() and not Path("/pwned").exists()


# --------------------------------------------------------------------------------------- the CLI
def test_cli_dry_run_json_starts_nothing(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.write_text("# rack 3\nnode-a slots=4   # spare\n\tnode-b\tslots=2\n")
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(
        dscore_cmd("--dry_run", "--json", "-H", str(hf), "-e", "node-a:0", "--launcher", "SSH", WORKER, "echo", str(out)),
        env=launcher_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["accelerator"] == "cpu"
    assert {"world_info", "processes", "commands", "runner"} <= set(data)
    assert data["runner"] == "ssh" and data["world_info"] == {"node-a": [1, 2, 3], "node-b": [0, 1]}
    assert [(q["host"], q["rank"], q["local_rank"]) for q in data["processes"]] == [
        ("node-a", 0, 0), ("node-a", 1, 1), ("node-a", 2, 2), ("node-b", 3, 0), ("node-b", 4, 1)]  # fmt: skip
    assert all(set(q) >= {"host", "rank", "local_rank", "env", "argv"} for q in data["processes"])
    assert [c["argv"][:4] for c in data["commands"]] == [["ssh", "-o", "BatchMode=yes", "node-a"]] * 1 + [
        ["ssh", "-o", "BatchMode=yes", "node-b"]]  # fmt: skip
    assert os.listdir(out) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-H", "{missing}"], "does not exist"),
        (["-H", "{bad}"], "{bad}:2: bad hostfile entry 'node-b'; expected 'host slots=N'"),
        (["-H", "{good}", "-i", "node-c"], "host 'node-c' is not in the hostfile/resource pool; valid hosts: node-a"),
        (["--launcher", "nope", "--num_gpus", "1"], "choose one of pdsh, ssh, openmpi, mpich, impi, mvapich, slurm"),
        (["--launcher_arg", "x", "--num_gpus", "1"], "unrecognized arguments"),
    ],
)
def test_cli_errors_exit_2_with_message(tmp_path: Path, argv: list[str], message: str) -> None:
    (tmp_path / "bad").write_text("node-a slots=1\nnode-b\n")
    (tmp_path / "good").write_text("node-a slots=1\n")
    paths = {"missing": str(tmp_path / "missing"), "bad": str(tmp_path / "bad"), "good": str(tmp_path / "good")}
    argv = [a.format(**paths) for a in argv]
    res = subprocess.run(dscore_cmd("--dry_run", *argv, "train.py"), env=launcher_env(), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2
    assert message.format(**paths) in res.stderr


def test_hostfile_error_carries_location(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.write_text("a slots=1\nb slots=x\n")
    with pytest.raises(HostfileError) as info:
        plan("-H", str(hf), "train.py")
    assert (info.value.path, info.value.line) == (str(hf), 2)


# ------------------------------------------------------------------------------------- core binding
def test_core_binding_plan_and_missing_numactl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore.launcher.local import parse_range_list
    from dscore.launcher.plan import execute

    p = plan("--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", "0,2-4,6-7", "t.py")
    assert [q.argv[:3] for q in p.processes] == [["numactl", "-C", "0,2,3"], ["numactl", "-C", "4,6,7"]]
    assert {q.env["OMP_NUM_THREADS"] for q in p.processes} == {"3"}
    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("3-1", "0-4,2", "a"):
        with pytest.raises(LauncherError, match="--bind_core_list"):
            parse_range_list(bad)
    with pytest.raises(LauncherError, match="cannot be split among 4 ranks"):
        plan("--num_gpus", "4", "--bind_cores_to_rank", "--bind_core_list", "0-2", "t.py")
    with pytest.raises(LauncherError, match="KMP_AFFINITY"):
        plan("--num_gpus", "1", "--bind_cores_to_rank", "t.py", environ={"KMP_AFFINITY": "compact"})
    monkeypatch.setenv("PATH", str(tmp_path))  # no numactl: refused before anything starts
    with pytest.raises(LauncherError, match="needs numactl"):
        execute(p)


def test_missing_runner_binary_is_refused(hostfile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore.launcher.plan import execute

    p = multi("pdsh", hostfile)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LauncherError, match="--launcher pdsh needs 'pdsh', which is not on PATH"):
        execute(p)


def test_launcher_stays_torch_free() -> None:
    """Importing the launcher and planning a sized local job never imports torch (no device probing)."""
    code = (
        "import sys, contextlib, io\n"
        "import dscore.cli.run, dscore.launcher.node, dscore.launcher.runners\n"
        "from dscore.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['run', '--dry_run', '--num_gpus', '2', 'train.py']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
