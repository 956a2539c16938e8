"""Hostfile grammar and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from dscore.errors import HostfileError
from dscore.launcher import hostfile
from dscore.launcher.hostfile import load_hostfile, parse_hostfile, parse_hostfile_text


def test_issue_example_comments_tabs_order() -> None:
    hosts = parse_hostfile_text("# rack 3\nnode-a slots=4   # spare\n\tnode-b\tslots=2\n")
    assert [(h.name, h.slots, h.line) for h in hosts] == [("node-a", 4, 2), ("node-b", 2, 3)]


def test_user_at_host_blank_lines_and_attributes() -> None:
    hosts = parse_hostfile_text("\n   \nalice@node-a   slots=8 max_slots=8\r\n\n10.0.0.2 slots=1\n")
    assert [(h.name, h.user, h.slots, h.target) for h in hosts] == [
        ("node-a", "alice", 8, "alice@node-a"),
        ("10.0.0.2", None, 1, "10.0.0.2"),
    ]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("node-a slots=2\nnode-b\n", 2),
        ("node-a slots = 2\n", 1),
        ("node-a SLOTS=2\n", 1),
        ("node-a slots=-1\n", 1),
        ("node-a slots=2.5\n", 1),
        ("node-a slots=0\n", 1),
        ("node-a slots=2 junk\n", 1),
        ("# c\n\nnode-a slots=2\nnode-b slots=1\nnode-a slots=3\n", 5),
    ],
)
def test_bad_lines_name_file_line_and_form(text: str, line: int) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text(text, "/etc/hf")
    assert info.value.path == "/etc/hf" and info.value.line == line
    assert f"/etc/hf:{line}" in str(info.value)


def test_duplicate_names_first_line() -> None:
    with pytest.raises(HostfileError, match="listed twice.*line 1"):
        parse_hostfile_text("a slots=1\nu@a slots=2\n")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "  \n\t\n"])
def test_zero_hosts_is_an_error(text: str) -> None:
    with pytest.raises(HostfileError, match="no hosts found; expected 'host slots=N'"):
        parse_hostfile_text(text, "hf")


def test_explicit_missing_hostfile_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="does not exist") as info:
        load_hostfile(str(tmp_path / "nope"))
    assert info.value.path == str(tmp_path / "nope")


def test_only_implicit_default_may_be_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(hostfile, "DEFAULT_HOSTFILE", str(tmp_path / "missing"))
    with caplog.at_level("INFO", logger="dscore.launcher.hostfile"):
        assert load_hostfile(None) is None
    assert "using local resources" in caplog.text
    present = tmp_path / "present"
    present.write_text("n1 slots=2\n")
    monkeypatch.setattr(hostfile, "DEFAULT_HOSTFILE", str(present))
    assert [h.name for h in load_hostfile(None) or []] == ["n1"]
    present.write_text("n1\n")
    with pytest.raises(HostfileError):
        load_hostfile(None)


def test_parse_hostfile_reads_file(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    path.write_text("w0 slots=1\nw1 slots=1\n")
    assert [h.name for h in parse_hostfile(path)] == ["w0", "w1"]
