"""Every ``DSCORE_*`` variable the code reads has a record (``dscore/env_vars.py``), and
``docs/environment-variables.md`` (``python -m dscore.process --write-docs``) is current (issue 37 item 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dscore import env_vars, process

FIX = (
    "add an EnvVar record (name, default, what it does) to ENV_VARS in dscore/env_vars.py, then run "
    f"`{process.REGENERATE}` and commit docs/environment-variables.md"
)


@pytest.fixture(scope="module")
def reads() -> dict[str, list[tuple[Path, int]]]:
    return env_vars.scan_reads()


def test_every_variable_read_has_a_record(reads: dict[str, list[tuple[Path, int]]]) -> None:
    missing = env_vars.undocumented(reads)
    assert not missing, "DSCORE_* variables read in the code without a record:\n" + "\n".join(
        f"  {n} ({', '.join(f'{p}:{ln}' for p, ln in reads[n][:3])})" for n in missing
    ) + f"\n{FIX}"


def test_every_record_is_read_somewhere(reads: dict[str, list[tuple[Path, int]]]) -> None:
    orphans = env_vars.unread(reads)
    assert not orphans, f"records of variables nothing reads (remove them from dscore/env_vars.py): {orphans}"


def test_the_document_is_current() -> None:
    current = process.DOC_PATH.read_text(encoding="utf-8") if process.DOC_PATH.exists() else ""
    stale = process.stale_lines(current)
    assert not stale, f"{process.DOC_PATH.name} is out of date ({stale[:3]} ...): run `{process.REGENERATE}`"


def test_the_check_command_agrees() -> None:
    out = subprocess.run([sys.executable, "-m", "dscore.process", "--check-docs"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_once_undocumented_variables_have_records() -> None:
    """The six the issue found in no user document, each with a default and a meaning of its own."""
    records = env_vars.by_name()
    for name in ("DSCORE_TIMEOUT", "DSCORE_SWAP_INDEX", "DSCORE_OPS_LOCK_TIMEOUT", "DSCORE_MALLOC_MMAP_THRESHOLD",
                 "DSCORE_CPU_SIMD", "DSCORE_CHECKPOINT_FSYNC"):
        assert records[name].default and len(records[name].meaning) > 60, name
        assert f"| `{name}` |" in process.DOC_PATH.read_text(encoding="utf-8")


def test_policy_variables_have_records() -> None:
    records = env_vars.by_name()
    for p in process.POLICIES:
        assert all(v in records for v in p.env), p
        assert p.zero_turns_off is None or p.zero_turns_off in p.env, p
    assert process.POLICY_ENV in records


def test_scan_finds_reads_and_skips_docstrings(tmp_path: Path) -> None:
    """The scan can fail: a new variable read in any of the usual ways is reported as undocumented."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        '"""Mentions DSCORE_H37_DOC_ONLY in prose only."""\n'
        "import os\n"
        "PROBE_ENV = \"DSCORE_H37_CONSTANT\"\n"
        "def f(env):\n"
        '    """DSCORE_H37_DOC_ONLY"""\n'
        '    a = os.environ.get("DSCORE_H37_GET")\n'
        '    b = os.getenv("DSCORE_H37_GETENV", "1")\n'
        '    c = env["DSCORE_H37_ITEM"]\n'
        '    d = f"DSCORE_H37_FSTRING={a}"\n'
        '    return a, b, c, d, "-DDSCORE_H37_MACRO", env.get(PROBE_ENV), os.environ.get("DSCORE_TIMEOUT")\n',
        encoding="utf-8",
    )
    reads = env_vars.scan_reads([pkg])
    assert set(reads) == {"DSCORE_H37_CONSTANT", "DSCORE_H37_GET", "DSCORE_H37_GETENV", "DSCORE_H37_ITEM",
                          "DSCORE_TIMEOUT"}
    assert env_vars.undocumented(reads) == ["DSCORE_H37_CONSTANT", "DSCORE_H37_GET", "DSCORE_H37_GETENV",
                                            "DSCORE_H37_ITEM"]
    assert reads["DSCORE_H37_GET"] == [(pkg / "mod.py", 6)]


def test_stale_check_can_fail() -> None:
    """A changed default or meaning makes the document stale; only the *read in* column may drift."""
    current = process.DOC_PATH.read_text(encoding="utf-8")
    row = next(line for line in current.splitlines() if line.startswith("| `DSCORE_TIMEOUT` |"))
    assert process.stale_lines(current.replace(row, row.replace("| 10 |", "| 11 |"))) != []
    assert process.stale_lines(current.replace(row, "")) != []
    drifted = row[: row[:-2].rfind(" | ")] + " | `dscore/somewhere_else.py` |"
    assert process.stale_lines(current.replace(row, drifted)) == []
