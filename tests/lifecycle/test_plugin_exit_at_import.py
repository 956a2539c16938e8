"""A plugin whose entry-point module calls ``sys.exit(1)`` at import (any BaseException but
KeyboardInterrupt) is marked ``broken`` with a one-line reason; everything not selecting it works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugin_system"))
from fakedist import write_distribution  # noqa: E402

from dscore.errors import PluginLoadError  # noqa: E402
from dscore.plugin_manager import create_plugin_manager  # noqa: E402
from dscore.registry import Registry  # noqa: E402

EXITS = """
import sys
sys.exit(1)
"""

RAISES = """
raise {exc}
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for mod in [m for m in sys.modules if m.startswith("fakeexit_")]:
        del sys.modules[mod]


def test_sys_exit_at_import_marks_the_plugin_broken(site: Path) -> None:
    write_distribution(site, "dscore-exits", "0.1", {"exits": "fakeexit_mod"}, {"fakeexit_mod": EXITS})
    manager = create_plugin_manager()
    record = manager.records["exits"]
    assert record.status == "broken"
    assert "sys.exit(1)" in record.error and "fakeexit_mod" in record.error
    assert "\n" not in record.error
    # everything else still works
    registry = Registry(manager)
    assert registry.get("optimizer", "adam").name.lower() == "adam"
    assert manager.records["cpu"].status == "active"


@pytest.mark.parametrize("exc", ["SystemExit('bye')", "GeneratorExit()", "BaseException('odd')"])
def test_any_base_exception_marks_broken(site: Path, exc: str) -> None:
    write_distribution(site, "dscore-odd", "0.1", {"odd": "fakeexit_odd"}, {"fakeexit_odd": RAISES.format(exc=exc)})
    record = create_plugin_manager().records["odd"]
    assert record.status == "broken", record


def test_keyboard_interrupt_still_interrupts(site: Path) -> None:
    write_distribution(
        site, "dscore-ki", "0.1", {"ki": "fakeexit_ki"}, {"fakeexit_ki": RAISES.format(exc="KeyboardInterrupt()")}
    )
    with pytest.raises(KeyboardInterrupt):
        create_plugin_manager()


def test_a_registration_hook_calling_sys_exit_is_broken_too(site: Path) -> None:
    source = """
from dscore import hookimpl
import sys

@hookimpl
def dscore_register_optimizers():
    sys.exit(3)
"""
    write_distribution(site, "dscore-hookexit", "0.1", {"hookexit": "fakeexit_hook"}, {"fakeexit_hook": source})
    record = create_plugin_manager().records["hookexit"]
    assert record.status == "broken" and "sys.exit(3)" in record.error


def test_selecting_a_component_of_the_broken_plugin_names_it(site: Path) -> None:
    write_distribution(site, "dscore-exits", "0.1", {"exits": "fakeexit_mod"}, {"fakeexit_mod": EXITS})
    registry = Registry(create_plugin_manager())
    with pytest.raises((PluginLoadError, LookupError)) as info:
        registry.get("optimizer", "ExitsOpt")
    assert "exits" in str(info.value) or "ExitsOpt" in str(info.value)


def test_plugins_list_cli_survives_and_reports_broken(site: Path) -> None:
    write_distribution(site, "dscore-exits", "0.1", {"exits": "fakeexit_mod"}, {"fakeexit_mod": EXITS})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "dscore", "plugins", "list", "--json"], capture_output=True, text=True, env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    records = {r["name"]: r for r in json.loads(res.stdout)}
    assert records["exits"]["status"] == "broken"
    assert "sys.exit(1)" in records["exits"]["error"]
    assert records["cpu"]["status"] == "active"


@pytest.mark.slow
def test_a_training_run_not_selecting_it_still_works(site: Path, tmp_path: Path) -> None:
    write_distribution(site, "dscore-exits", "0.1", {"exits": "fakeexit_mod"}, {"fakeexit_mod": EXITS})
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, dscore\n"
        "model = torch.nn.Linear(3, 1)\n"
        "engine, *_ = dscore.initialize(model=model, config={'train_micro_batch_size_per_gpu': 2,"
        " 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
        "loss = engine(torch.ones(2, 3)).sum(); engine.backward(loss); engine.step()\n"
        "print('trained', engine.global_steps)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained 1" in res.stdout
