"""What a new user reads: `dscore plugins list [--probe]`, `dscore report`, `dscore config check` text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _dscore(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "dscore", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd or REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


# ------------------------------------------------------------------------------------------ plugins
def test_plugins_list_probe_says_which_accelerators_are_usable_here(monkeypatch: pytest.MonkeyPatch) -> None:
    # wide enough that no cell wraps whatever third-party accelerators are installed (the test device is)
    monkeypatch.setenv("COLUMNS", "240")
    from dscore.accelerator import probe_accelerator
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import AcceleratorSpec

    registry = Registry(create_plugin_manager())
    expected: dict[str, dict[str, bool]] = {}
    for spec in registry.specs("accelerator"):
        assert isinstance(spec, AcceleratorSpec)
        expected.setdefault(registry.provider(spec).name, {})[spec.name] = probe_accelerator(spec).available
    assert expected.get("cpu") == {"cpu": True}

    rows = {r["name"]: r for r in json.loads(_dscore("plugins", "list", "--probe", "--json").stdout)}
    for plugin, names in expected.items():
        got = rows[plugin]["usable"]
        assert {name: entry["usable"] for name, entry in got.items()} == names
        assert all(entry["reason"] for entry in got.values())
    assert rows["optimizers"]["usable"] is None  # not an accelerator plugin

    table = _dscore("plugins", "list", "--probe", "--kind", "accelerator").stdout
    assert "usable here" in table and "yes (the host CPU is always usable)" in table
    unusable = [p for p, names in expected.items() if not any(names.values())]
    if unusable:
        assert "no (" in table


def test_plugins_list_without_probe_explains_active_and_stays_torch_free() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from dscore.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['plugins', 'list', '--kind', 'accelerator'])\n"
        "import json; print(json.dumps(buf.getvalue()))\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    printed, status = proc.stdout.strip().rsplit("\n", 1)
    assert status == "0 False"
    text = " ".join(json.loads(printed).split())  # rich wraps long lines
    assert "always usable" not in text  # no probe ran
    assert "'active' means the plugin loaded" in text and "dscore plugins list --probe" in text


# ------------------------------------------------------------------------------------------- report
def test_report_explains_the_accelerator_choice_once() -> None:
    report = json.loads(_dscore("report", "--json").stdout)
    reason = report["accelerator"]["value"]["reason"]
    proc = _dscore("report")
    both = proc.stdout + proc.stderr
    head = reason.split("; skipped ")[0]
    assert both.count(head.split("(", 1)[-1].rstrip(")")) == 1, both
    for item in reason.split("; skipped ")[1:2]:
        for part in item.split("; "):
            name, _, why = part.partition(": ")
            if why:
                assert both.count(why) == 1, (why, both)
                assert f"not usable: {name}: {why}" in proc.stdout


# ------------------------------------------------------------------------------------- config check
def test_config_check_text_reads_as_sentences(tmp_path: Path) -> None:
    out = _dscore("config", "check", "examples/gpt/ds_config.json", "--world-size", "2").stdout
    first = out.splitlines()[0]
    assert first == "examples/gpt/ds_config.json is valid for 2 processes (from --world-size)."
    assert "train_batch_size = 32" in out and "offload_param_device = none" in out
    assert "pending_auto" not in out and " = -" not in out and "None" not in out

    out = _dscore("config", "check", "examples/mlp/ds_config.json").stdout
    assert "valid for 1 process (the default; pass --world-size N" in out.splitlines()[0]

    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}))
    out = _dscore("config", "check", str(path)).stdout
    assert 'left as "auto" until dscore.initialize sees the model: zero_optimization.reduce_bucket_size' in out
