"""dscore.rollout.weight_sync refuses bad arguments with a WeightSyncError naming them, before any connection."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from dscore.errors import WeightSyncError
from dscore.rollout import WeightSyncGroup, WeightSyncReceiver, WeightSyncSender
from dscore.rollout.weight_sync import _pid_gone


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"host": ""}, "host="),
        ({"port": 0}, "port=0"),
        ({"port": True}, "port=True"),
        ({"world_size": 1}, "world_size=1"),
        ({"rank": 2}, "rank=2"),
        ({"rank": -1}, "rank=-1"),
        ({"timeout": 0}, "timeout=0"),
        ({"timeout": "5"}, "timeout='5'"),
        ({"rendezvous_timeout": -1.0}, "rendezvous_timeout=-1.0"),
        ({"device": "meta"}, "device='meta'"),
        ({"device": "nonsense"}, "device='nonsense'"),
        pytest.param({"device": "cuda"}, "device='cuda'.*no NCCL/CUDA", marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="this machine has CUDA")),
    ],
)
def test_group_arguments_are_checked(kwargs: dict, named: str) -> None:
    args = {"host": "127.0.0.1", "port": 1, "world_size": 2, "rank": 0, **kwargs}
    with pytest.raises(WeightSyncError, match=named.replace("(", r"\(")):
        WeightSyncGroup(args.pop("host"), args.pop("port"), args.pop("world_size"), args.pop("rank"), **args)


def test_sender_and_receiver_arguments_are_checked() -> None:
    rank0 = SimpleNamespace(global_rank=0)
    rank1 = SimpleNamespace(global_rank=1)
    with pytest.raises(WeightSyncError, match="src_rank; group must be its WeightSyncGroup"):
        WeightSyncSender(rank0, None)
    with pytest.raises(WeightSyncError, match="group given on training rank 1, but src_rank is 0"):
        WeightSyncSender(rank1, object())  # type: ignore[arg-type]
    for kwargs, named in (({"bucket_bytes": 0}, "bucket_bytes=0"), ({"dtype": "fp16"}, "dtype='fp16'"),
                          ({"names": "x"}, "names='x'"), ({"src_rank": -1}, "src_rank=-1")):
        with pytest.raises(WeightSyncError, match=named):
            WeightSyncSender(rank1, None, **kwargs)  # type: ignore[arg-type]
    sender = WeightSyncSender(rank1, None, dtype=torch.bfloat16)  # a rank that does not send needs no group
    with pytest.raises(WeightSyncError, match="step=-1"):
        sender.send(-1)
    with pytest.raises(WeightSyncError, match="a WeightSyncGroup of a receiver"):
        WeightSyncReceiver(object())  # type: ignore[arg-type]


def test_a_missing_receiver_fails_the_rendezvous_in_bounded_time() -> None:
    from dscore.testing import find_free_port

    with pytest.raises(WeightSyncError, match=r"not every member joined .* within 1s"):
        WeightSyncGroup("127.0.0.1", find_free_port(), 2, 0, timeout=1)
    with pytest.raises(WeightSyncError, match=r"rank 1\) failed within 1s"):
        WeightSyncGroup("127.0.0.1", find_free_port(), 2, 1, timeout=1)  # nobody serves the store


def test_pid_gone_tells_a_live_process_from_a_reaped_or_zombie_one() -> None:
    assert not _pid_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while not os.path.exists(f"/proc/{child.pid}/stat") or open(f"/proc/{child.pid}/stat").read().split()[2] != "Z":
        time.sleep(0.01)  # not reaped yet: a zombie once it exited
    assert _pid_gone(child.pid)
    child.wait()
    assert _pid_gone(child.pid)
