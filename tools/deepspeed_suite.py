"""The DeepSpeed conformance tier: DeepSpeed's own unit suite run against the compat distribution.

DeepSpeed's ``tests/unit`` (a snapshot in ``../shared/reference/deepspeed-tests``, Apache-2.0; run from
there, never copied into this repository) is run with DeepSpeed's CPU CI command: ``pytest --forked`` over
``unit/`` with the snapshot's ``pytest.ini`` marker selection, then ``pytest --forked -m sequential``, with
``LOCAL_SIZE=2`` so DeepSpeed's CPU-accelerator convention reports two devices and ``world_size=2`` tests run.
CI's ``-n 4`` (pytest-xdist) is left out: this machine has two cores. ``import deepspeed`` resolves to
whatever the interpreter sees: the compat distribution (``python`` of dscore's venv) or a real DeepSpeed
(``--python /work/bench-venv/bin/python``, the baseline side).

Modes:

* ``collect``: import mode, ``--collect-only``: which files import, which tests collect, and each failing
  file's first missing name, ranked by the tests it blocks (the DeepSpeed side's count of that file's tests).
  A minute or two.
* ``run``: the two CI commands, time-boxed (``--budget`` seconds over both, ``--timeout`` per test); what
  ran before the box closed is kept and the page says how far it got.
* ``report``: regenerate ``docs/deepspeed-suite.md`` from the saved measurements.

Measurements go to ``build/deepspeed-suite/<side>-<mode>.jsonl`` (``side`` is ``dscore`` or ``deepspeed``,
from the interpreter's ``deepspeed.__version__``; ``--out`` elsewhere), each ending with a ``meta`` line
carrying the UTC ``date`` and the ``commit`` measured (``-dirty`` with uncommitted changes). Unless
``--no-page``, a measurement is also saved into the repository (``tools/deepspeed_suite/records/`` for
dscore, ``baseline/`` for DeepSpeed) and the page regenerated: the page always shows the newest collect record
with the last run records, each marked with its date and commit, so a run taken on an older commit than the
import-mode numbers is flagged as stale rather than dropped. A collect takes half a minute; a run, hours. Failures are classed by
``tools/deepspeed_suite/reasons.toml`` (first matching pattern wins); what no pattern matches is listed as
unclassified. Exit status: 0 when measured (failing tests are the page's content, not an error), 2 on a usage
error; with ``../shared`` absent it prints why and exits 0 (skipped).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SUITE_DEFAULT = ROOT.parent / "shared" / "reference" / "deepspeed-tests"
SUITE = SUITE_DEFAULT
HERE = ROOT / "tools" / "deepspeed_suite"
REASONS = HERE / "reasons.toml"
OUT_DIR = ROOT / "build" / "deepspeed-suite"
PAGE = ROOT / "docs" / "deepspeed-suite.md"
# The DeepSpeed side's records, kept in the repository: measured once with a real DeepSpeed 0.19.8 (a scratch
# venv, never a dependency) so the page regenerates without one.
BASELINE = HERE / "baseline"
# the dscore side's last records, kept in the repository so the page (and the CI import floor,
# tests/unit/test_deepspeed_suite_floor.py) regenerate from them without re-running hours of tests
RECORDS = HERE / "records"

# The snapshot's pytest.ini deselects these markers (besides `sequential`, which the second CI command
# selects); import mode collects both CI selections at once.
INI_DESELECTED = ("nightly", "inference", "seq_inference", "inference_ops", "inference_v2", "inference_v2_ops",
                  "stable_diffusion", "evaluation")
BOTH_SELECTIONS = " and ".join(f"not {m}" for m in INI_DESELECTED)

CLASSES = ("dscore defect", "deliberate difference", "DeepSpeed-private internal")
_MISSING = (
    re.compile(r"No module named '(?P<name>[\w.]+)'"),
    re.compile(r"cannot import name '(?P<attr>\w+)' from '(?P<mod>[\w.]+)'"),
    re.compile(r"module '(?P<mod>[\w.]+)' has no attribute '(?P<attr>\w+)'"),
)


def missing_name(message: str) -> str:
    """The dotted name an import error message says is missing (``deepspeed.pipe``,
    ``deepspeed.accelerator.is_current_accelerator_supported``), or ``""`` when it names none."""
    for pattern in _MISSING:
        m = pattern.search(message)
        if m:
            groups = m.groupdict()
            return groups.get("name") or f"{groups['mod']}.{groups['attr']}"
    return ""


@dataclass
class Reason:
    """One row of ``reasons.toml``: failures whose message (or node id) matches ``pattern`` are ``klass``."""

    pattern: re.Pattern[str]
    klass: str
    reason: str
    target: str = "message"


def load_reasons(path: Path = REASONS) -> list[Reason]:
    """The classification rows of ``path``, in file order.

    Raises:
        ValueError: a row with a class outside :data:`CLASSES`, a target other than ``message``/``nodeid``,
            or a pattern that is not a valid regular expression (naming the row).
    """
    rows = tomllib.loads(path.read_text(encoding="utf-8")).get("reason", [])
    out = []
    for i, row in enumerate(rows):
        where = f"{path}: [[reason]] #{i + 1}"
        if row.get("class") not in CLASSES:
            raise ValueError(f"{where}: class {row.get('class')!r} is not one of {CLASSES}")
        target = row.get("target", "message")
        if target not in ("message", "nodeid"):
            raise ValueError(f"{where}: target {target!r} must be 'message' or 'nodeid'")
        try:
            pattern = re.compile(row["pattern"])
        except (KeyError, re.error) as exc:
            raise ValueError(f"{where}: bad pattern ({exc})") from exc
        out.append(Reason(pattern, row["class"], row["reason"], target))
    return out


def classify(nodeid: str, message: str, reasons: list[Reason]) -> tuple[str, str]:
    """``(class, reason)`` of a failure by the first row matching it; ``("unclassified", message)`` else.
    A reason may name the pattern's groups (``{name}``) and ``{missing}`` (:func:`missing_name`)."""
    for r in reasons:
        m = r.pattern.search(nodeid if r.target == "nodeid" else message)
        if m:
            values = collections.defaultdict(str, m.groupdict(), missing=missing_name(message))
            return r.klass, r.reason.format_map(values)
    return "unclassified", message


def area_of(path: str) -> str:
    """The top-level directory of ``tests/unit`` a node id or file lies in (``(unit)`` for files directly
    in it)."""
    parts = path.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 else "(unit)"


# ------------------------------------------------------------------------------------------- measuring


def side_of(python: str) -> str:
    """``dscore`` when ``python`` imports the compat distribution, ``deepspeed`` for a real DeepSpeed.

    Raises:
        SystemExit: ``python`` cannot import ``deepspeed`` at all.
    """
    proc = subprocess.run([python, "-c", "import deepspeed; print(getattr(deepspeed, '__dscore__', False))"],
                          capture_output=True, text=True, env=_env(), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{python}: `import deepspeed` fails:\n{proc.stderr.strip()[-2000:]}")
    return "dscore" if proc.stdout.strip().splitlines()[-1] == "True" else "deepspeed"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["LOCAL_SIZE"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return env


def _check_plugins(python: str) -> None:
    proc = subprocess.run([python, "-c", "import pytest_forked, pytest_timeout"], capture_output=True,
                          env=_env(), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{python}: pytest-forked and pytest-timeout are needed (DeepSpeed's CI runs with "
                         "--forked): pip install -e '.[test]' installs them")


def _pytest(python: str, record: Path, args: list[str], deadline: float | None) -> tuple[int, bool]:
    """Run pytest in the suite's ``tests/`` until done or ``deadline`` (time.monotonic); ``(rc, cut)``."""
    cmd = [python, "-m", "pytest", "unit/", "-p", "recorder", f"--ds-suite-record={record}",
           "--continue-on-collection-errors", "-p", "no:cacheprovider", "-q", *args]
    with open(record.with_suffix(".log"), "a", encoding="utf-8") as log:
        log.write(f"$ LOCAL_SIZE=2 {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=SUITE / "tests", env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
            return rc, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the session pytest and its forked/spawned children
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return -1, True


def _commit() -> str:
    """The checkout's ``HEAD`` (12 hex digits), ``-dirty`` when tracked files differ from it; ``unknown``
    outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def measure(mode: str, python: str, budget: float, timeout: int, *, save: bool = True) -> Path:
    """Run ``mode`` (``collect`` or ``run``) with ``python``; returns the JSON-lines record written to
    ``OUT_DIR``. With ``save`` it is copied into the repository too (:data:`RECORDS` for dscore,
    :data:`BASELINE` for DeepSpeed), where the page is generated from."""
    _check_plugins(python)
    side = side_of(python)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    record = OUT_DIR / f"{side}-{mode}.jsonl"
    for stale in (record, record.with_suffix(".log")):
        stale.unlink(missing_ok=True)
    start = time.monotonic()
    deadline = start + budget if budget > 0 else None
    meta: dict[str, object] = {"kind": "meta", "side": side, "mode": mode, "python": python,
                               "budget_s": budget, "timeout_s": timeout, "commit": _commit(),
                               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if mode == "collect":
        _, cut = _pytest(python, record, ["--collect-only", "-m", BOTH_SELECTIONS], deadline)
        meta["cut"] = cut
    else:
        common = ["--forked", f"--timeout={timeout}"]
        _, cut1 = _pytest(python, record, common, deadline)
        cut2 = True
        if not cut1:
            _, cut2 = _pytest(python, record, [*common, "-m", "sequential"], deadline)
        meta["cut"] = cut1 or cut2
        meta["sequential_ran"] = not cut1
    meta["wall_s"] = round(time.monotonic() - start, 1)
    with open(record, "a", encoding="utf-8") as f:
        f.write(json.dumps(meta) + "\n")
    if save:
        kept = BASELINE if side == "deepspeed" else RECORDS
        kept.mkdir(parents=True, exist_ok=True)
        (kept / record.name).write_bytes(record.read_bytes())
    return record


def record_path(side: str, mode: str) -> Path:
    """Where the page reads ``side``'s ``mode`` record from: the one saved in the repository
    (:data:`RECORDS` / :data:`BASELINE`), else this checkout's ``OUT_DIR``."""
    kept = (BASELINE if side == "deepspeed" else RECORDS) / f"{side}-{mode}.jsonl"
    return kept if kept.exists() else OUT_DIR / kept.name


def taken(m: Measurement) -> str:
    """``"2026-12-02T07:00:23Z, commit 1234abcd5678"``: when and on what a record was measured."""
    return f"{m.meta.get('date', 'date not recorded')}, commit {m.meta.get('commit', 'not recorded')}"


# ------------------------------------------------------------------------------------------- reading


@dataclass
class Measurement:
    """One side's record, folded: files failing import (message), tests collected, final test outcomes."""

    meta: dict[str, object] = field(default_factory=dict)
    collect_errors: dict[str, str] = field(default_factory=dict)
    items: dict[str, bool] = field(default_factory=dict)  # nodeid -> sequential
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)  # nodeid -> (outcome, message)

    def tests_per_file(self) -> collections.Counter[str]:
        return collections.Counter(n.split("::")[0] for n in self.items)


def read(path: Path) -> Measurement | None:
    """The measurement in ``path`` (``None`` when absent). A test's outcome is ``failed`` when any phase
    failed (``error`` when only setup/teardown did), ``skipped`` when a phase skipped, else ``passed``."""
    if not path.exists():
        return None
    m = Measurement()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed run
            continue
        kind = ev.get("kind")
        if kind == "meta":
            m.meta = ev
        elif kind == "collect_error":
            m.collect_errors.setdefault(ev["file"], ev["message"])
        elif kind == "item":
            m.items[ev["nodeid"]] = ev["sequential"]
        elif kind == "report":
            prev = m.outcomes.get(ev["nodeid"])
            outcome = ev["outcome"]
            if outcome == "failed" and ev["when"] != "call":
                outcome = "error"
            if prev is None or prev[0] == "passed" or (prev[0] == "skipped" and outcome in ("failed", "error")):
                m.outcomes[ev["nodeid"]] = (outcome, ev["message"])
    return m


def all_files() -> list[str]:
    """Every ``test_*.py`` of the snapshot's ``tests/unit``, as node-id paths (``unit/...``)."""
    base = SUITE / "tests"
    return sorted(str(p.relative_to(base)) for p in (base / "unit").rglob("test_*.py"))


# ------------------------------------------------------------------------------------------- the page


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def blockers(ours: Measurement, theirs: Measurement | None) -> list[tuple[str, int, int]]:
    """``(first missing name, files, tests blocked)`` over the files failing import on dscore, most tests
    first; a file's tests are counted on the DeepSpeed side (0 without a baseline or where it fails there)."""
    per_file = theirs.tests_per_file() if theirs else collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    for path, message in ours.collect_errors.items():
        name = missing_name(message) or message
        files[name] += 1
        tests[name] += per_file[path]
    return sorted(((n, files[n], tests[n]) for n in files), key=lambda r: (-r[2], -r[1], r[0]))


def render(reasons: list[Reason]) -> str:
    """The text of ``docs/deepspeed-suite.md`` from the saved measurements of both sides."""
    files = all_files()
    col = {s: read(record_path(s, "collect")) for s in ("dscore", "deepspeed")}
    run = {s: read(record_path(s, "run")) for s in ("dscore", "deepspeed")}
    ours = col["dscore"]
    lines = [
        "# DeepSpeed's unit suite on dscore (generated)",
        "",
        "Generated by `python tools/deepspeed_suite.py` (`make test-deepspeed-suite`); do not edit. DeepSpeed's",
        "`tests/unit` (snapshot in `../shared/reference/deepspeed-tests`, run from there) against the compat",
        "distribution, with DeepSpeed's CPU CI command: `LOCAL_SIZE=2 pytest --forked unit/` (the snapshot's",
        "`pytest.ini` marker selection), then `pytest --forked -m sequential unit/` (CI's `-n 4` is left out on",
        "two cores). The DeepSpeed side is the same command with DeepSpeed 0.19.8 installed. Import mode is",
        "`--collect-only` over both selections. Failure classes come from `tools/deepspeed_suite/reasons.toml`.",
        "",
    ]
    if ours is None:
        return "\n".join([*lines, "No measurement of the dscore side yet: run `make test-deepspeed-suite`.", ""])
    theirs = col["deepspeed"]

    def collect_summary(m: Measurement | None) -> str:
        if m is None:
            return "not measured"
        failing = len(m.collect_errors)
        return (f"{len(files) - failing} of {len(files)} files import, {len(m.items)} tests collect "
                f"({sum(m.items.values())} `sequential`); {m.meta.get('wall_s', '?')} s ({taken(m)})")

    lines += ["## Import mode", "", f"* dscore: {collect_summary(ours)}", f"* DeepSpeed 0.19.8: {collect_summary(theirs)}",
              ""]
    ours_run, theirs_run = run["dscore"], run["deepspeed"]

    def run_summary(m: Measurement | None) -> str:
        if m is None:
            return "not run"
        c = collections.Counter(o for o, _ in m.outcomes.values())
        how = "cut by its time box" if m.meta.get("cut") else "complete"
        if m.meta.get("cut") and not m.meta.get("sequential_ran"):
            how += ", before the `sequential` part"
        stale = ""
        if m.meta.get("side") == "dscore" and m.meta.get("commit") != ours.meta.get("commit"):
            stale = "; **stale**: measured on another commit than the import mode above"
        return (f"{c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped']} skipped in "
                f"{m.meta.get('wall_s', '?')} s ({how}; per-test timeout {m.meta.get('timeout_s')} s; "
                f"{taken(m)}{stale})")

    lines += ["## Run mode", "",
              "The last run of each side (hours on two cores, so rarer than import mode): its numbers, and the run",
              "columns of the tables below, are those of the commit it names.", "",
              f"* dscore: {run_summary(ours_run)}", f"* DeepSpeed 0.19.8: {run_summary(theirs_run)}", ""]

    # per area
    def per_area(m: Measurement | None, key: str) -> collections.Counter[str]:
        c: collections.Counter[str] = collections.Counter()
        if m is None:
            return c
        if key == "files":
            for f in files:
                c[area_of(f)] += 1
        elif key == "import_fail":
            for f in m.collect_errors:
                c[area_of(f)] += 1
        elif key == "items":
            for n in m.items:
                c[area_of(n)] += 1
        else:
            for n, (o, _) in m.outcomes.items():
                if o == key or (key == "failed" and o == "error"):
                    c[area_of(n)] += 1
        return c

    areas = sorted({area_of(f) for f in files})
    nf, fail, items = per_area(ours, "files"), per_area(ours, "import_fail"), per_area(ours, "items")
    ds_items, ds_fail = per_area(theirs, "items"), per_area(theirs, "import_fail")
    p, f_, s = (per_area(ours_run, k) for k in ("passed", "failed", "skipped"))
    ds_p = per_area(theirs_run, "passed")
    rows = [[a, nf[a], nf[a] - fail[a], fail[a], items[a], p[a], f_[a], s[a],
             f"{nf[a] - ds_fail[a]} / {ds_items[a]} / {ds_p[a]}" if theirs else "-"] for a in areas]
    lines += ["## Per area", "", "Area: the top-level directory of `tests/unit`. Passed/failed/skipped are from the",
              "dscore run (blank areas did not run before its time box closed). DeepSpeed column: files importing /",
              "tests collected / tests passed on DeepSpeed 0.19.8.", ""]
    lines += _table(["area", "files", "import", "fail import", "tests collected", "passed", "failed", "skipped",
                     "DeepSpeed"], rows)
    lines += ["", "## First missing name per failing file, ranked by tests blocked", "",
              "Tests blocked: the tests those files collect on DeepSpeed 0.19.8.", ""]
    lines += _table(["first missing name (or error)", "files", "tests blocked"],
                    [[f"`{n}`", nf_, t] for n, nf_, t in blockers(ours, theirs)])

    # reasons
    failures: list[tuple[str, str, str, str]] = []  # (kind, id, class, reason)
    for path, message in sorted(ours.collect_errors.items()):
        failures.append(("import", path, *classify(path, message, reasons)))
    if ours_run is not None:
        for n, (o, message) in sorted(ours_run.outcomes.items()):
            if o in ("failed", "error"):
                failures.append(("test", n, *classify(n, message, reasons)))
    by_reason: collections.Counter[tuple[str, str]] = collections.Counter((k, r) for _, _, k, r in failures)
    lines += ["", "## Reasons", "", "Every failing file (import) and failing test, by class and reason; `unclassified`",
              "means no row of `reasons.toml` matches (the message is shown).", ""]
    lines += _table(["class", "reason", "failures"], [[k, r.replace("|", "\\|"), c] for (k, r), c in
                                                       sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))])
    lines += ["", "## Every failure", ""]
    lines += _table(["what", "node", "class", "reason"],
                    [[w, f"`{i}`", k, r.replace("|", "\\|")] for w, i, k, r in failures])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    global SUITE, OUT_DIR  # noqa: PLW0603 - the settings every helper reads
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("collect", "run", "report", "all"), nargs="?", default="all",
                    help="all: collect then run (the make target)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose `deepspeed` is measured")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the run mode in all (0: no limit)")
    ap.add_argument("--timeout", type=int, default=300, help="per-test timeout of the run mode, seconds")
    ap.add_argument("--suite", type=Path, default=SUITE_DEFAULT,
                    help="the snapshot folder holding tests/unit (default ../shared/reference/deepspeed-tests)")
    ap.add_argument("--no-page", action="store_true",
                    help="measure only: leave docs/deepspeed-suite.md and the records saved in the repository")
    ap.add_argument("--out", type=Path, default=None, help="folder of the measurements (default build/deepspeed-suite)")
    args = ap.parse_args(argv)
    SUITE = args.suite.resolve()
    if args.out is not None:
        OUT_DIR = args.out.resolve()
    if not (SUITE / "tests" / "unit").is_dir():
        print(f"deepspeed suite: skipped, {SUITE}/tests/unit is absent (../shared/reference not laid here)")
        return 0
    reasons = load_reasons()
    modes = {"all": ["collect", "run"], "report": []}.get(args.mode, [args.mode])
    for mode in modes:
        record = measure(mode, args.python, args.budget if mode == "run" else 0, args.timeout, save=not args.no_page)
        m = read(record)
        assert m is not None
        print(f"deepspeed suite [{m.meta['side']} {mode}]: {len(all_files()) - len(m.collect_errors)} of "
              f"{len(all_files())} files import, {len(m.items)} tests collected; "
              f"{dict(collections.Counter(o for o, _ in m.outcomes.values()))} in {m.meta['wall_s']} s"
              f"{' (cut by the time box)' if m.meta.get('cut') else ''}; record {record}")
    if not args.no_page:
        PAGE.write_text(render(reasons), encoding="utf-8")
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
