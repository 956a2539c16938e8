"""Issue 38 item 9a: ``dscore run --local_rank_spelling local-rank`` passes torchrun's ``--local-rank=N``
instead of DeepSpeed's ``--local_rank=N`` (DeepSpeed 0.19.8's launcher has no such choice, only
``--no_local_rank``), through the real launcher: local ranks and the per-node launcher of multi-node runs."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_helpers import WORKER, dscore_cmd, launcher_env, read_ranks

from dscore.errors import LauncherError
from dscore.launcher.accel import AcceleratorLaunchInfo
from dscore.launcher.node import encode_world_info
from dscore.launcher.options import add_arguments
from dscore.launcher.plan import build_plan

CUDA = AcceleratorLaunchInfo(name="cuda", visible_devices_vars=("CUDA_VISIBLE_DEVICES",), export_prefixes=())


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=launcher_env(), capture_output=True, text=True, timeout=120)


def test_local_ranks_get_the_hyphen_spelling(tmp_path: Path) -> None:
    res = _run(dscore_cmd("--num_gpus", "2", "--local_rank_spelling", "local-rank", WORKER, "echo", str(tmp_path)))
    assert res.returncode == 0, res.stderr
    for lr, r in enumerate(read_ranks(tmp_path, 2)):
        assert r["argv"][1:] == [f"--local-rank={lr}", "echo", str(tmp_path)]


def test_node_launcher_forwards_the_spelling(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "dscore.launcher.node", f"--world_info={encode_world_info({'h': [0, 1]})}",
            "--node_rank=0", "--master_addr=127.0.0.1", "--local_rank_spelling=local-rank", WORKER, "echo",
            str(tmp_path)]
    res = _run(argv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["argv"][1] for r in read_ranks(tmp_path, 2)] == ["--local-rank=0", "--local-rank=1"]


def _plan(tmp_path: Path, *argv: str):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return build_plan(parser.parse_args(["-H", str(hostfile), *argv, "train.py"]), environ={}, cwd="/proj",
                      accel=CUDA)


def test_pdsh_node_command_carries_the_spelling_and_the_help_names_it(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "--local_rank_spelling", "local-rank")
    assert "--local_rank_spelling=local-rank" in plan.commands[0].argv[-1]
    assert plan.processes[2].argv[-1] == "--local-rank=0"
    assert "--local_rank_spelling=" not in _plan(tmp_path).commands[0].argv[-1]  # the default adds nothing
    res = _run(dscore_cmd("--help"))
    assert "--local_rank_spelling" in res.stdout and "--local-rank=N" in res.stdout


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--no_local_rank", "--local_rank_spelling", "local-rank"], r"--no_local_rank with --local_rank_spelling"),
        (["--launcher", "openmpi", "--local_rank_spelling", "local-rank"],
         r"--local_rank_spelling local-rank with --launcher openmpi: its ranks get no local-rank argument"),
    ],
)
def test_contradictions_are_refused(tmp_path: Path, argv: list[str], pattern: str) -> None:
    with pytest.raises(LauncherError, match=pattern):
        _plan(tmp_path, *argv)


def test_unknown_spelling_is_an_argparse_error(tmp_path: Path) -> None:
    res = _run(dscore_cmd("--local_rank_spelling", "localrank", WORKER, "echo", str(tmp_path)))
    assert res.returncode == 2 and "invalid choice: 'localrank'" in res.stderr
