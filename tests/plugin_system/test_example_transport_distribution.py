"""Tier 3: a third-party comm transport (examples/plugins/dscore-example-transport) is pip-installed into a
temporary venv, listed by ``dscore plugins list --json``, asked first for every collective of a 2-rank gloo
job, and delegates to the transport that would have run it: results equal torch.distributed's, and the
bytes and routes it recorded are exactly the calls made (shm on one host; p2p / the backend's own with
``comm_transport:shm`` disabled)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_example_plugin_distribution import _pip, _plugins_json, plugin_venv  # noqa: F401 - the shared venv fixture

REPO = Path(__file__).resolve().parents[2]
TRANSPORT_SRC = REPO / "examples" / "plugins" / "dscore-example-transport"

pytestmark = pytest.mark.slow

JOB = r'''
import json
import os

from dscore.testing import run_distributed


def collectives():
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore_example_transport.transport import counts, reset

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    reset()
    got, want = {}, {}

    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    ref = x.clone()
    dist.all_reduce(ref)
    y = x.clone()
    comm.all_reduce(y)
    got["sum"], want["sum"] = y.tolist(), ref.tolist()
    y = x.clone()
    comm.all_reduce(y, op="avg")
    got["avg"], want["avg"] = y.tolist(), (ref / world).tolist()
    y = x.clone()
    comm.all_reduce(y, op="max")  # not a sum or average: never offered to a transport, so not counted
    ref_max = x.clone()
    dist.all_reduce(ref_max, op=dist.ReduceOp.MAX)
    got["max"], want["max"] = y.tolist(), ref_max.tolist()

    src = torch.arange(5, dtype=torch.float64) * (rank + 1)
    refs = [torch.empty(5, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(refs, src)
    flat = torch.empty(world * 5, dtype=torch.float64)
    comm.all_gather_into_tensor(flat, src)
    got["gather_flat"], want["gather_flat"] = flat.tolist(), torch.cat(refs).tolist()
    outs = [torch.empty(5, dtype=torch.float64) for _ in range(world)]
    work = comm.all_gather(outs, src, async_op=True)
    work.wait()
    got["gather_list"], want["gather_list"] = [o.tolist() for o in outs], [r.tolist() for r in refs]

    inp = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    full = inp.clone()
    dist.all_reduce(full)
    out = torch.empty(4, dtype=torch.float32)
    comm.reduce_scatter_tensor(out, inp)
    got["rs"], want["rs"] = out.tolist(), full[rank * 4 : (rank + 1) * 4].tolist()
    return {"got": got, "want": want, "counts": counts(), "transports": [t.name for t in comm.transports]}


if __name__ == "__main__":
    print(json.dumps(run_distributed(collectives, 2, timeout=240)))
'''


def _job(py: Path, tmp_path: Path, env: dict[str, str]) -> list[dict]:
    job = tmp_path / "transport_example_job.py"
    job.write_text(JOB)
    run = subprocess.run([py, str(job)], capture_output=True, text=True, timeout=400, cwd=tmp_path,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_counting_transport_delegates_and_counts(plugin_venv: Path, tmp_path: Path) -> None:  # noqa: F811
    py = plugin_venv
    src = tmp_path / "dscore-example-transport"
    shutil.copytree(TRANSPORT_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip(py, "install", "--no-deps", "--no-build-isolation", str(src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        rows = {r["name"]: r for r in _plugins_json(py)}
        row = rows["example_transport"]
        assert row["status"] == "active" and row["builtin"] is False, row
        assert row["distribution"] == "dscore-example-transport"
        assert row["provides"] == {"comm_transport": ["counting"]}
        assert rows["comm"]["provides"]["comm_transport"] == ["p2p", "shm"]

        on_shm = _job(py, tmp_path, {"DSCORE_DISABLE_PLUGINS": ""})
        on_p2p = _job(py, tmp_path, {"DSCORE_DISABLE_PLUGINS": "comm_transport:shm"})
    finally:
        _pip(py, "uninstall", "-y", "dscore-example-transport")

    for res in (*on_shm, *on_p2p):
        assert res["got"] == res["want"]  # exactly torch.distributed's results
    assert [r["got"] for r in on_shm] == [r["got"] for r in on_p2p]
    # asked first (priority 1000), above the built-ins
    assert on_shm[0]["transports"] == ["counting", "shm", "p2p"]
    assert on_p2p[0]["transports"] == ["counting", "p2p"]
    # the bytes each rank handed in: 2 all-reduces of 6 float32, 2 all-gathers of 5 float64, one
    # reduce-scatter of 2 x 4 float32 (the max all-reduce never reached a transport)
    expected_bytes = {"all_reduce": (2, 48), "all_gather": (2, 80), "reduce_scatter": (1, 32)}
    for res in (*on_shm, *on_p2p):
        assert {op: (row["calls"], row["bytes"]) for op, row in res["counts"].items()} == expected_bytes
    # delegated to what would have run: shared memory on one host; without it gloo point-to-point for the
    # pairwise exchanges and the backend's own all-reduce
    for res in on_shm:
        assert {op: row["via"] for op, row in res["counts"].items()} == {
            "all_reduce": {"shm": 2}, "all_gather": {"shm": 2}, "reduce_scatter": {"shm": 1},
        }
    for res in on_p2p:
        assert {op: row["via"] for op, row in res["counts"].items()} == {
            "all_reduce": {"native": 2}, "all_gather": {"p2p": 2}, "reduce_scatter": {"p2p": 1},
        }
