"""Tier 3: the example plugin distribution is really pip-installed into a temporary venv, seen by
`dscore plugins list --json` and selectable by name, then uninstalled."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN_SRC = REPO / "examples" / "plugins" / "dscore-example-plugin"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (system site packages) bridged to the test interpreter's site-packages, so torch and the
    editable dscore are importable there while the plugin is installed only in the temp venv."""
    root = tmp_path_factory.mktemp("plugin-venv")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root)
    py = root / "bin" / "python"
    target_site = Path(
        subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    )
    parent_sites = [p for p in site.getsitepackages() if Path(p).is_dir()]
    # "import" lines in a .pth file run at start-up; addsitedir also processes the parent's .pth files
    # (the editable-install finder of dscore lives in one of them).
    (target_site / "_dscore_parent_site.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parent_sites)
    )
    return py


def _pip(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _plugins_json(py: Path) -> list[dict]:
    proc = subprocess.run([py, "-m", "dscore", "plugins", "list", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_install_list_select_uninstall(plugin_venv: Path, tmp_path: Path) -> None:
    py = plugin_venv
    assert "example" not in {r["name"] for r in _plugins_json(py)}

    # setuptools builds in the source folder (build/, *.egg-info): install from a copy in tmp_path
    src = tmp_path / "dscore-example-plugin"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip(py, "install", "--no-deps", "--no-build-isolation", str(src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in _plugins_json(py)}
    row = rows["example"]
    assert row["builtin"] is False
    assert row["distribution"] == "dscore-example-plugin" and row["version"] == "0.1.0"
    assert row["status"] == "active", row["error"]
    assert row["provides"] == {"lr_scheduler": ["InverseSqrtLR"], "optimizer": ["SignSGD"]}

    # selected by config, built by dscore.initialize through the typed contexts, it really trains a step
    code = (
        "import torch, dscore\n"
        "model = torch.nn.Linear(2, 1, bias=False)\n"
        "with torch.no_grad(): model.weight.copy_(torch.tensor([[1.0, -2.0]]))\n"
        "cfg = {'train_batch_size': 1, 'gradient_clipping': 0.0,\n"
        "       'optimizer': {'type': 'SignSGD', 'params': {'lr': 0.5, 'momentum': 0.0}},\n"
        "       'scheduler': {'type': 'InverseSqrtLR', 'params': {'warmup_num_steps': 1}}}\n"
        "engine, opt, _, sched = dscore.initialize(model=model, config=cfg)\n"
        "loss = engine(torch.tensor([[3.0, -4.0]])).sum()\n"
        "engine.backward(loss); engine.step()\n"
        "print(engine.module.weight.detach().flatten().tolist(), sched.get_last_lr())\n"
        "engine.close()\n"
    )
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # lr at step 0 of InverseSqrtLR is 0 -> no movement; sched then moves to step 1 -> lr 0.5
    assert proc.stdout.strip().splitlines()[-1] == "[1.0, -2.0] [0.5]", proc.stdout

    # a bad value is refused at initialize with the key path, like dscore's own optimizers
    bad = code.replace("'momentum': 0.0", "'momentum': 1.5")
    proc = subprocess.run([py, "-c", bad], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "ConfigError" in proc.stderr and "optimizer.params.momentum" in proc.stderr

    proc = _pip(py, "uninstall", "-y", "dscore-example-plugin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "example" not in {r["name"] for r in _plugins_json(py)}
