"""Exports to remote nodes: prefixes, .deepspeed_env parsing, quoting safety (checked with a real sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dscore.errors import LauncherError
from dscore.launcher.envfile import EnvVar, collect_exports, expand_references, parse_env_file, shell_export


def test_prefixes_pythonpath_and_files_in_order(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\r\n\r\nB=cwd\r\nEXTRA_FLAGS=--opt=1,--mode=fast\r\n")
    environ = {"NCCL_DEBUG": "INFO", "UCX_TLS": "rc", "MV2_X": "1", "PYTHONPATH": "/lib", "HOME_X": "no", "FI_P": "y"}
    got = {v.name: v.value for v in collect_exports(environ, cwd=str(cwd), home=str(home), extra_prefixes=["FI_"])}
    assert got == {
        "FI_P": "y",
        "MV2_X": "1",
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": f"{cwd}:/lib",
        "UCX_TLS": "rc",
        "A": "home",
        "B": "cwd",
        "EXTRA_FLAGS": "--opt=1,--mode=fast",
    }


def test_ds_env_file_picks_one_file(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("IGNORED=1\n")
    chosen = tmp_path / "chosen.env"
    chosen.write_text("ONLY=1\n")
    got = collect_exports({"DS_ENV_FILE": str(chosen)}, cwd=str(tmp_path), home=str(tmp_path))
    assert [v.name for v in got] == ["PYTHONPATH", "ONLY"]
    with pytest.raises(LauncherError, match="DS_ENV_FILE="):
        collect_exports({"DS_ENV_FILE": str(tmp_path / "missing")}, cwd=str(tmp_path), home=str(tmp_path))


@pytest.mark.parametrize(("text", "line"), [("A=1\nNOEQUALS\n", 2), ("\n\n1BAD=x\n", 3), ("=x\n", 1)])
def test_bad_lines_name_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    path = tmp_path / "env"
    path.write_text(text)
    with pytest.raises(LauncherError, match=rf"{path}:{line}: "):
        parse_env_file(str(path))


def _remote_shell(exports: list[EnvVar], names: list[str], extra_env: dict[str, str] | None = None) -> list[str]:
    script = "; ".join(shell_export(v) for v in exports) + "; " + " ".join(f'printf "%s\\0" "${n}";' for n in names)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=extra_env or {}, check=True)
    return out.stdout.split("\0")[:-1]


def test_values_are_quoted_for_the_remote_shell(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    nasty = [
        "two words",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"'; touch {marker}; '",
        'quote " and \\ backslash',
        "$HOME",
        "--opt=1,--mode=fast",
        "",
    ]
    exports = [EnvVar(f"V{i}", v) for i, v in enumerate(nasty)]
    assert _remote_shell(exports, [v.name for v in exports]) == nasty
    assert not marker.exists()


def test_expand_form_expands_variables_only(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    var = EnvVar("LIB", f'/opt/lib:${{BASE}}:$BASE/x:$(touch {marker}):`touch {marker}`:"q":$', expand=True)
    assert _remote_shell([var], ["LIB"], {"BASE": "/b"}) == [
        f'/opt/lib:/b:/b/x:$(touch {marker}):`touch {marker}`:"q":$'
    ]
    assert not marker.exists()


def test_expand_marker_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "env"
    path.write_text("LD_LIBRARY_PATH=@expand:/opt:${LD_LIBRARY_PATH}\nPLAIN=@x\n")
    got = parse_env_file(str(path))
    assert [(v.name, v.value, v.expand) for v in got] == [
        ("LD_LIBRARY_PATH", "/opt:${LD_LIBRARY_PATH}", True),
        ("PLAIN", "@x", False),
    ]


def test_file_values_with_references_expand_on_the_node_and_nothing_else(tmp_path: Path) -> None:
    """The .deepspeed_env rule: $NAME/${NAME} expand remotely (no marker needed); the rest stays literal,
    and the shell form (pdsh/ssh) and the shell-free form (MPI runners' node entry) give the same value."""
    marker = tmp_path / "pwned"
    path = tmp_path / "env"
    lines = {
        "LD_LIBRARY_PATH": "/opt/efa/lib:$LD_LIBRARY_PATH",
        "BRACED": "${BASE}/x y",
        "INJECT": f"a; touch {marker}",
        "SUBST": f"$(touch {marker})`touch {marker}`$BASE",
        "QUOTES": "\"q\" 'p' \\ ${BASE:-d} $ $1",
        "PLAIN": "no refs; $(x)",
        "EQ": "k=v=w",
    }
    path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    got = parse_env_file(str(path))
    assert {v.name: v.expand for v in got} == {
        "LD_LIBRARY_PATH": True, "BRACED": True, "INJECT": False, "SUBST": True, "QUOTES": False, "PLAIN": False,
        "EQ": False}  # fmt: skip
    remote = {"LD_LIBRARY_PATH": "/usr/lib", "BASE": "/b"}
    expected = [
        "/opt/efa/lib:/usr/lib", "/b/x y", f"a; touch {marker}", f"$(touch {marker})`touch {marker}`/b",
        "\"q\" 'p' \\ ${BASE:-d} $ $1", "no refs; $(x)", "k=v=w"]  # fmt: skip
    assert _remote_shell(got, list(lines), remote) == expected
    assert [expand_references(v.value, remote) if v.expand else v.value for v in got] == expected
    assert expand_references("$UNSET:${UNSET}:x", {}) == "::x"
    assert not marker.exists()
