"""``dscore ops``, ``dscore report`` and import hygiene (no torch, no compiler, no CUDA needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dscore.cli.main import main
from dscore.cli.ops import select_ops
from dscore.specs import OpBuilderSpec

_SPECS = [
    OpBuilderSpec(name="cpu_adam", builder="x:y", device_types=("cpu",), build_env_var="DS_BUILD_CPU_ADAM"),
    OpBuilderSpec(name="cpu_lion", builder="x:y", device_types=("cpu",), build_env_var="DS_BUILD_CPU_LION"),
    OpBuilderSpec(name="fused_adam", builder="x:y", device_types=("cuda",), build_env_var="DS_BUILD_FUSED_ADAM"),
]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"DS_BUILD_OPS": "1"}, ["cpu_adam", "cpu_lion", "fused_adam"]),
        ({"DS_BUILD_OPS": "1", "DS_BUILD_FUSED_ADAM": "0"}, ["cpu_adam", "cpu_lion"]),
        ({"DS_BUILD_CPU_LION": "1"}, ["cpu_lion"]),
        ({"DS_BUILD_OPS": "0", "DS_BUILD_CPU_ADAM": "1"}, ["cpu_adam"]),
        ({"DS_BUILD_OPS": "0"}, []),
        ({"DS_BUILD_QUANTIZER": "1"}, []),  # an op dscore lacks still means "only the named ops"
        ({"DS_BUILD_QUANTIZER": "1", "DS_BUILD_CPU_ADAM": "1"}, ["cpu_adam"]),
        ({"DS_BUILD_STRING": "+abc"}, None),  # DeepSpeed's version suffix, not an op
    ],
)
def test_select_ops_honours_ds_build_vars(env: dict[str, str], expected: list[str] | None) -> None:
    chosen = select_ops(_SPECS, env)
    assert (None if chosen is None else [s.name for s in chosen]) == expected


def test_unknown_build_variables_are_reported() -> None:
    from dscore.cli.ops import unknown_build_variables

    env = {"DS_BUILD_QUANTIZER": "1", "DS_BUILD_CPU_ADAMM": "1", "DS_BUILD_FOO": "0", "DS_BUILD_CPU_ADAM": "1",
           "DS_BUILD_OPS": "0"}
    got = {var: (wanted, msg) for var, wanted, msg in unknown_build_variables(_SPECS, env)}
    assert set(got) == {"DS_BUILD_QUANTIZER", "DS_BUILD_CPU_ADAMM", "DS_BUILD_FOO"}
    assert got["DS_BUILD_QUANTIZER"][0] and "DeepSpeed's 'quantizer' op, which dscore does not provide" in got[
        "DS_BUILD_QUANTIZER"][1]
    assert "a typo?" in got["DS_BUILD_CPU_ADAMM"][1] and "cpu_adam (DS_BUILD_CPU_ADAM)" in got["DS_BUILD_CPU_ADAMM"][1]
    assert got["DS_BUILD_FOO"][0] is False


def test_ops_build_honours_only_the_named_ds_build_variables(tmp_path: Path) -> None:
    """``DS_BUILD_QUANTIZER=1 DS_BUILD_CPU_LION=1 dscore ops build``: the unknown variable fails the command by
    name, only cpu_lion is considered (it fails: no compiler here), no other op is touched."""
    env = _bare_env(tmp_path)
    env.update(DS_BUILD_QUANTIZER="1", DS_BUILD_CPU_LION="1")
    proc = subprocess.run([sys.executable, "-m", "dscore", "ops", "build"], env=env, capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "DS_BUILD_QUANTIZER=1: DeepSpeed's 'quantizer' op, which dscore does not provide" in out
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("built", "skipped", "FAILED   "))
             and "DS_BUILD_" not in ln.split()[1]]
    assert [ln.split()[1].rstrip(":") for ln in lines] == ["cpu_lion"], out
    assert not any(tmp_path.rglob("*.so"))


def _bare_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST"}}
    env.update(CXX="/nonexistent/c++", CUDA_HOME=str(tmp_path / "no-cuda"), TORCH_EXTENSIONS_DIR=str(tmp_path))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"
    return env


def test_import_and_ops_list_need_no_torch_compiler_or_cuda(tmp_path: Path) -> None:
    code = (
        "import sys, dscore, dscore.ops, dscore.ops.builder, dscore.env_report, dscore.cli.ops, dscore.cli.report\n"
        "import dscore_plugins.ops.plugin, dscore_plugins.ops.builders\n"
        "from dscore.cli.main import main\n"
        "rc = main(['ops', 'list', '--json'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_bare_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["name"] for r in rows} >= {"cpu_adam", "cpu_adagrad", "cpu_lion", "fused_adam", "fused_lamb", "fused_lion"}
    assert not any(tmp_path.rglob("*.so"))


def test_report_never_crashes_without_toolchain(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dscore.env_report", "--json"], env=_bare_env(tmp_path),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "CXX" in report["cxx"]["error"] and report["cxx"]["value"] is None
    assert "no-cuda" in report["nvcc"]["error"]
    ops = {r["name"]: r for r in report["ops"]["value"]}
    assert not ops["fused_adam"]["compatible"] and ops["fused_adam"]["reason"]
    assert ops["cpu_adam"]["built"] is None and "CXX" in ops["cpu_adam"]["built_reason"]
    assert report["torch"]["value"]["version"]


def test_report_shows_failing_accelerator_selection_as_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import dscore.accelerator as accelerator
    from dscore.env_report import collect_report, format_report

    def broken(registry: object, requested: str | None = None) -> None:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(accelerator, "select_accelerator", broken)
    report = collect_report()
    assert report["accelerator"]["error"] == "RuntimeError: probe exploded"
    text = format_report(report)
    assert "accelerator" in text and "probe exploded" in text and "cpu_adam" in text


def test_report_cli_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    for needle in ("torch", "ninja", "C++ compiler", "accelerator", "cpu_adam", "fused_lion"):
        assert needle in out


def test_ops_build_named_incompatible_op_fails(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.version.cuda:
        pytest.skip("this torch has CUDA; fused_adam may be compatible here")
    assert main(["ops", "build", "fused_adam"]) == 1
    assert "not compatible" in capsys.readouterr().out


def test_ops_build_unknown_name_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ops", "build", "cpu_adma"]) == 2
    assert "cpu_adam" in capsys.readouterr().err
