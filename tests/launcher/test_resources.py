"""Include/exclude/--num_nodes/--num_gpus resolution (DeepSpeed 0.19.8 semantics, loud errors)."""

from __future__ import annotations

import pytest

from dscore.errors import LauncherError
from dscore.launcher.resources import select_resources

POOL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, POOL),
        ({"include": "worker-1"}, {"worker-1": [0, 1, 2, 3]}),
        ({"include": "worker-1:2,0,2@worker-0:3"}, {"worker-0": [3], "worker-1": [0, 2]}),
        ({"include": "worker-0@worker-0:1"}, {"worker-0": [1]}),
        ({"include": "worker-0:1@worker-0:3"}, {"worker-0": [1, 3]}),
        ({"exclude": "worker-1"}, {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ({"exclude": "worker-0:0,1@worker-2:0,1"}, {"worker-0": [2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"num_gpus": 1}, {"worker-0": [0], "worker-1": [0], "worker-2": [0]}),
        ({"num_nodes": 1, "num_gpus": 6}, {"worker-0": [0, 1, 2, 3, 4, 5]}),
    ],
)
def test_selection(kwargs: dict, expected: dict) -> None:
    assert select_resources(POOL, **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"include": "worker-9"}, r"host 'worker-9' is not in .*valid hosts: worker-0, worker-1, worker-2"),
        ({"include": "worker0"}, r"Did you mean 'worker-0'"),
        ({"include": "worker-2:5"}, r"--include 'worker-2:5': host 'worker-2' has no slot 5; valid slots: 0,1"),
        ({"exclude": "worker-2:x"}, r"--exclude .*slot 'x' of host 'worker-2' is not an integer; valid slots: 0,1"),
        ({"include": "worker-0:"}, r"empty slot list for host 'worker-0'"),
        ({"include": "worker-0:1,"}, r"empty slot list"),
        ({"include": "worker-0:1:2"}, r"not an integer"),
        ({"include": "worker-0@@worker-1"}, r"empty host entry"),
        ({"include": "worker-0", "exclude": "worker-1"}, r"mutually exclusive"),
        ({"include": "worker-0", "num_nodes": 1}, r"cannot be combined with --num_nodes 1"),
        ({"exclude": "worker-0", "num_gpus": 0}, r"cannot be combined with --num_gpus 0"),
        ({"exclude": "worker-0@worker-1@worker-2"}, r"leaves no slots"),
        ({"num_nodes": 4}, r"--num_nodes 4 is out of range: 3 host\(s\) .*valid values are 1..3"),
        ({"num_nodes": 0}, r"--num_nodes 0 is out of range"),
        ({"num_gpus": 0}, r"--num_gpus/--nproc_per_node 0 is out of range"),
    ],
)
def test_errors_name_filter_and_choices(kwargs: dict, pattern: str) -> None:
    with pytest.raises(LauncherError, match=pattern):
        select_resources(POOL, **kwargs)


def test_ranks_sharing_a_node_split_the_cores_unless_omp_num_threads_is_set() -> None:
    import os

    from dscore.launcher.local import build_rank_processes

    kw = dict(master_addr="127.0.0.1", master_port=29500, script="train.py", script_args=[])
    specs = build_rank_processes({"localhost": [0, 1]}, 0, environ={}, **kw)
    expected = str(max(1, (os.cpu_count() or 1) // 2))
    assert [s.env["OMP_NUM_THREADS"] for s in specs] == [expected, expected]
    specs = build_rank_processes({"localhost": [0, 1]}, 0, environ={"OMP_NUM_THREADS": "4"}, **kw)
    assert all("OMP_NUM_THREADS" not in s.env for s in specs)  # the caller's value is inherited untouched
    specs = build_rank_processes({"localhost": [0]}, 0, environ={}, **kw)
    assert "OMP_NUM_THREADS" not in specs[0].env
