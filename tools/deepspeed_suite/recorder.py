"""A pytest plugin that records, as JSON lines, what ``tools/deepspeed_suite.py`` reports on.

Loaded with ``-p recorder`` (the tool puts this folder on ``PYTHONPATH``) and ``--ds-suite-record=PATH``.
One line per event, appended and flushed at once so a run stopped by its time box keeps what it measured:

* ``{"kind": "collect_error", "file": ..., "message": ...}``: a test file that failed to import;
* ``{"kind": "item", "nodeid": ..., "sequential": bool}``: a test collected (after marker selection);
* ``{"kind": "report", "nodeid": ..., "when": "setup"|"call"|"teardown", "outcome": ..., "message": ...}``.

With ``--forked`` each test's reports are produced in a child and handed back to the parent, where this hook
records them, so a test that kills its child still shows up (as pytest-forked's crash report).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

_FILE = None

# the exception line pytest prints last ("E   ModuleNotFoundError: No module named 'x'")
_EXC_LINE = re.compile(r"^(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed)\b.*)$")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--ds-suite-record", default=None, help="append collection and test events to this file")


def pytest_configure(config: pytest.Config) -> None:
    global _FILE
    path = config.getoption("--ds-suite-record")
    if path and not hasattr(config, "workerinput"):
        _FILE = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the session


def _emit(event: dict[str, Any]) -> None:
    if _FILE is not None:
        _FILE.write(json.dumps(event) + "\n")
        _FILE.flush()


def summary_line(text: str) -> str:
    """The most telling line of a failure's text: the last exception line, else its last non-empty line."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        m = _EXC_LINE.match(line.strip())
        if m:
            return m.group(1)[:500]
    return lines[-1].strip()[:500] if lines else ""


def _message(report: Any) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:500]
    if report.passed:
        return ""
    text = str(report.longreprtext)
    for line in reversed(text.splitlines()):  # the raised exception, wherever the traceback ends
        m = _EXC_LINE.match(line.strip())
        if m:
            return m.group(1)[:500]
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return summary_line(crash.message) or crash.message[:500]
    return summary_line(text)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit({"kind": "collect_error", "file": report.nodeid.split("::")[0], "message": _message(report)})


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _emit({"kind": "item", "nodeid": item.nodeid, "sequential": item.get_closest_marker("sequential") is not None})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _emit({"kind": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "message": _message(report)})
