"""Tier 3: a third-party launcher back end (examples/plugins/dscore-example-launcher) is pip-installed into a
temporary venv, listed under ``provides.launcher``, and runs a real 2-host job with ``dscore run --launcher
localsh`` (both hosts played by this machine); ``launcher:localsh`` disabling refuses it, naming the unit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_example_plugin_distribution import _pip, _plugins_json, plugin_venv  # noqa: F401 - the shared venv fixture

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_SRC = REPO / "examples" / "plugins" / "dscore-example-launcher"
WORKER = REPO / "tests" / "launcher" / "worker.py"

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "DS_ENV_FILE")}
    env.pop("DSCORE_DISABLE_PLUGINS", None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def test_install_list_and_launch(plugin_venv: Path, tmp_path: Path) -> None:  # noqa: F811
    py = plugin_venv
    src = tmp_path / "dscore-example-launcher"
    shutil.copytree(LAUNCHER_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip(py, "install", "--no-deps", "--no-build-isolation", str(src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        rows = {r["name"]: r for r in _plugins_json(py)}
        row = rows["example_launcher"]
        assert row["builtin"] is False and row["status"] == "active", row["error"]
        assert row["distribution"] == "dscore-example-launcher" and row["version"] == "0.1.0"
        assert row["provides"] == {"launcher": ["localsh"]}
        assert set(rows["launch"]["provides"]["launcher"]) == {"pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm"}

        # a real job: two "hosts" (2 + 1 slots), each started from the script the back end writes for it
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("node-a slots=2\nnode-b slots=1\n")
        out, scripts = tmp_path / "out", tmp_path / "scripts"
        out.mkdir()

        def dscore_run(*options: str, disable: str = "") -> subprocess.CompletedProcess[str]:
            argv = [str(py), "-m", "dscore", "run", "-H", str(hostfile), "--master_addr", "127.0.0.1", *options,
                    str(WORKER), "echo", str(out)]  # fmt: skip
            env = _env(DSCORE_DISABLE_PLUGINS=disable) if disable else _env()
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)

        localsh = ("--launcher", "localsh", "--launcher_args", f"--script_dir {scripts}")
        dry = dscore_run("--dry_run", "--json", *localsh)
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout)
        assert plan["runner"] == "localsh" and [c["argv"][0] for c in plan["commands"]] == ["bash", "bash"]
        assert not scripts.exists()  # --dry_run writes nothing
        proc = dscore_run(*localsh)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks = [json.loads((out / f"rank{r}.json").read_text())["env"] for r in range(3)]
        assert [(e["RANK"], e["LOCAL_RANK"], e["CROSS_RANK"], e["WORLD_SIZE"]) for e in ranks] == [
            ("0", "0", "0", "3"), ("1", "1", "0", "3"), ("2", "0", "1", "3")]  # fmt: skip
        assert {e["MASTER_ADDR"] for e in ranks} == {"127.0.0.1"}
        assert sorted(p.name for p in scripts.iterdir()) == ["node0-node-a.sh", "node1-node-b.sh"]
        text = (scripts / "node1-node-b.sh").read_text()
        assert "-m dscore.launcher.node" in text and "--node_rank=1" in text and str(WORKER) in text

        # the unit disabled: refused naming it; the built-in back ends are untouched
        off = dscore_run("--dry_run", *localsh, disable="launcher:localsh")
        assert off.returncode == 2 and "'launcher:localsh'" in off.stderr and "example_launcher" in off.stderr, off.stderr
        ssh = dscore_run("--dry_run", "--launcher", "ssh", disable="launcher:localsh")
        assert ssh.returncode == 0 and "runner: ssh" in ssh.stdout, ssh.stderr
    finally:
        proc = _pip(py, "uninstall", "-y", "dscore-example-launcher")
        assert proc.returncode == 0, proc.stdout + proc.stderr
