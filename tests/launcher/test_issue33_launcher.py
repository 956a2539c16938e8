"""Issue 33 items 6 and 13, issue 29 item 9 (AISC exports): launcher plans.

Item 6 (DeepSpeed #1331): ``CUDA_VISIBLE_DEVICES=4,5`` with ``--include localhost:0,1`` or ``--num_gpus 2``
pinned the ranks to physical devices 0,1, outside the job's devices. Slots now index the visible list.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from dscore.errors import LauncherError
from dscore.launcher.accel import AcceleratorLaunchInfo
from dscore.launcher.envfile import collect_exports
from dscore.launcher.hostfile import DEFAULT_HOSTFILE
from dscore.launcher.options import add_arguments
from dscore.launcher.plan import build_plan

CUDA = AcceleratorLaunchInfo(name="cuda", visible_devices_vars=("CUDA_VISIBLE_DEVICES",), export_prefixes=("NCCL",))


def _plan(*argv: str, environ: dict[str, str]):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return build_plan(parser.parse_args(argv), environ=environ, cwd="/proj", accel=CUDA)


@pytest.mark.parametrize(
    ("argv", "devices"),
    [
        (("--include", "localhost:0,1"), [4, 5]),
        (("--num_gpus", "2"), [4, 5]),
        (("--include", "localhost:1"), [5]),
        (("--exclude", "localhost:0"), [5]),
        ((), [4, 5]),
    ],
)
def test_slots_index_the_visible_devices(argv: tuple[str, ...], devices: list[int], caplog) -> None:
    with caplog.at_level(logging.INFO, logger="dscore.launcher"):
        p = _plan(*argv, "train.py", environ={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert p.world_info == {"localhost": devices}
    want = ",".join(map(str, devices))
    assert [q.env["CUDA_VISIBLE_DEVICES"] for q in p.processes] == [want] * len(devices)
    assert any("CUDA_VISIBLE_DEVICES=4,5" in r.getMessage() for r in caplog.records)  # how it was read


def test_a_slot_outside_the_visible_devices_is_refused() -> None:
    with pytest.raises(LauncherError, match="2"):
        _plan("--include", "localhost:2", "train.py", environ={"CUDA_VISIBLE_DEVICES": "4,5"})


def test_num_nodes_without_hostfile_names_the_default_path() -> None:
    if Path(DEFAULT_HOSTFILE).exists():
        pytest.skip(f"{DEFAULT_HOSTFILE} exists on this machine")
    with pytest.raises(LauncherError, match=f"default {DEFAULT_HOSTFILE} does not exist"):
        _plan("--num_nodes", "2", "train.py", environ={})


def test_aisc_jobs_do_not_export_node_local_nic_choices(tmp_path: Path) -> None:
    environ = {"NCCL_IB_HCA": "mlx5_0", "UCX_NET_DEVICES": "mlx5_0:1", "NCCL_DEBUG": "INFO", "UCX_TLS": "tcp"}
    names = {v.name for v in collect_exports(environ, cwd=str(tmp_path), home=str(tmp_path))}
    assert {"NCCL_IB_HCA", "UCX_NET_DEVICES", "NCCL_DEBUG", "UCX_TLS"} <= names
    aisc = {**environ, "AISC_JOB_NAME": "job-1"}
    names = {v.name for v in collect_exports(aisc, cwd=str(tmp_path), home=str(tmp_path), extra_prefixes=["NCCL"])}
    assert "NCCL_IB_HCA" not in names and "UCX_NET_DEVICES" not in names
    assert {"NCCL_DEBUG", "UCX_TLS"} <= names
