"""Rendezvous ports of a single-node ``dscore run``: no --master_port picks a free port (and logs it);
an explicit busy port fails in the launcher, before any rank starts, naming the port, its holder and
--master_port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

RANK_SCRIPT = """
import os, sys
with open(os.path.join(sys.argv[-1], "rank" + os.environ["RANK"]), "w") as fh:
    fh.write(os.environ["MASTER_PORT"])
"""


def _listener(port: int) -> socket.socket | None:
    """A socket listening on ``port`` on every interface, or None when something else already holds it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("0.0.0.0", port))
    except OSError:
        sock.close()
        return None
    sock.listen(1)
    return sock


@pytest.fixture
def busy_port() -> Iterator[int]:
    for _ in range(20):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.bind(("", 0))
        port = int(probe.getsockname()[1])
        probe.close()
        sock = _listener(port)
        if sock is not None:
            yield port
            sock.close()
            return
    pytest.fail("could not hold a port for the test")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dscore", "run", "--num_gpus", "2", *args, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_default_port_busy_picks_a_free_port_and_logs_it(tmp_path: Path) -> None:
    """The issue's input: a second job without --master_port while 29500 is held."""
    held = _listener(29500)  # None: something else holds 29500 already, which is the same situation
    try:
        res = _run(tmp_path)
    finally:
        if held is not None:
            held.close()
    assert res.returncode == 0, res.stderr
    ports = {(tmp_path / f"rank{r}").read_text() for r in (0, 1)}
    assert len(ports) == 1
    (port,) = ports
    assert port != "29500"
    assert f"using free port {port}" in res.stderr


def test_explicit_busy_port_fails_before_any_rank_starts(tmp_path: Path, busy_port: int) -> None:
    res = _run(tmp_path, "--master_port", str(busy_port))
    assert res.returncode != 0
    assert f"--master_port {busy_port} is already in use" in res.stderr, res.stderr
    assert f"pid {os.getpid()}" in res.stderr, "the holding process (this test) must be named"
    assert "Traceback" not in res.stderr
    assert not list(tmp_path.glob("rank[0-9]")), "no rank may start"


def test_explicit_free_port_is_used(tmp_path: Path) -> None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    res = _run(tmp_path, "--master_port", str(port))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "rank0").read_text() == str(port)


def test_port_holder_names_a_listening_process(busy_port: int) -> None:
    from dscore.errors import LauncherError
    from dscore.launcher.local import check_master_port, port_holder

    assert port_holder(busy_port).startswith(f"pid {os.getpid()} ")
    with pytest.raises(LauncherError, match="--master_port"):
        check_master_port(busy_port)
    with pytest.raises(LauncherError, match="1..65535"):
        check_master_port(70000)
