"""``pip install ./compat/deepspeed`` replaces an installed DeepSpeed (same distribution name; never both).

A temporary venv holds a stand-in for a DeepSpeed 0.19.8 install (its module and ``dist-info`` with a
RECORD, as pip writes them); pip then installs compat/deepspeed into it for real.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _site(py: Path) -> Path:
    out = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def test_pip_install_replaces_a_deepspeed_install(tmp_path: Path, repo_root: Path) -> None:
    root = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(root)
    py = root / "bin" / "python"
    site = _site(py)
    # a DeepSpeed 0.19.8 as pip would have installed it
    (site / "deepspeed").mkdir()
    (site / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(
        "deepspeed/__init__.py,,\ndeepspeed-0.19.8.dist-info/METADATA,,\n"
        "deepspeed-0.19.8.dist-info/INSTALLER,,\ndeepspeed-0.19.8.dist-info/RECORD,,\n"
    )
    src = tmp_path / "compat-deepspeed"  # setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(repo_root / "compat" / "deepspeed", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check", "install", "--no-deps",
         str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successfully uninstalled deepspeed-0.19.8" in proc.stdout, proc.stdout
    infos = sorted(p.name for p in site.glob("deepspeed-*.dist-info"))
    assert infos == ["deepspeed-0.19.8+dscore0.1.0.dist-info"]
    probe = subprocess.run(
        [py, "-c", "import deepspeed, importlib.metadata as m; print(deepspeed.__dscore__, m.version('deepspeed'))"],
        capture_output=True, text=True, timeout=120,
    )
    assert probe.stdout.split() == ["True", "0.19.8+dscore0.1.0"], probe.stderr
    scripts = {p.name for p in (root / "bin").iterdir()}
    assert {"deepspeed", "ds_report"} <= scripts
