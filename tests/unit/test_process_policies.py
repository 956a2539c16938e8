"""Process-wide policy in one module (issue 37 item 5): ``DSCORE_PROCESS_POLICIES`` switches every policy,
an unknown name is refused with a did-you-mean, each policy site really does nothing when its policy is off,
and ``dscore report`` shows the states."""

from __future__ import annotations

import atexit
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from dscore import process
from dscore.errors import ConfigError

ALL = {p.name for p in process.POLICIES}


# ------------------------------------------------------------------------------------------- the switch
def test_default_is_every_policy_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (process.POLICY_ENV, "DSCORE_EXIT_DRAIN_S", "DSCORE_MALLOC_MMAP_THRESHOLD"):
        monkeypatch.delenv(var, raising=False)
    assert process.selected_policies() == ALL
    assert all(process.enabled(n) for n in ALL)
    assert process.policy_state("exit_drain") == (True, "DSCORE_PROCESS_POLICIES is unset (default all)")
    assert process.selected_policies({process.POLICY_ENV: "all"}) == ALL
    assert process.selected_policies({process.POLICY_ENV: " ALL "}) == ALL


def test_none_and_lists() -> None:
    assert process.selected_policies({process.POLICY_ENV: "none"}) == frozenset()
    env = {process.POLICY_ENV: "exit_drain, rendezvous_env"}
    assert process.selected_policies(env) == {"exit_drain", "rendezvous_env"}
    assert process.policy_state("exit_drain", env) == (True, "listed in DSCORE_PROCESS_POLICIES=exit_drain, rendezvous_env")
    on, why = process.policy_state("group_exit_hook", env)
    assert not on and why.startswith("not listed in DSCORE_PROCESS_POLICIES=")
    assert process.policy_state("group_exit_hook", {process.POLICY_ENV: "none"}) == (False, "DSCORE_PROCESS_POLICIES=none")


def test_own_variable_zero_turns_a_policy_off() -> None:
    assert process.policy_state("exit_drain", {"DSCORE_EXIT_DRAIN_S": "0"}) == (False, "DSCORE_EXIT_DRAIN_S=0")
    assert process.policy_state("exit_drain", {"DSCORE_EXIT_DRAIN_S": "5"})[0]
    assert not process.enabled("malloc_mmap_threshold", {"DSCORE_MALLOC_MMAP_THRESHOLD": "0"})


def test_unknown_policy_is_refused_with_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"'exit_drian' is not a process policy \(did you mean 'exit_drain'\?\)"):
        process.selected_policies({process.POLICY_ENV: "exit_drian"})
    with pytest.raises(ConfigError, match="stand alone"):
        process.selected_policies({process.POLICY_ENV: "all,exit_drain"})
    with pytest.raises(ConfigError, match="did you mean 'torch_group_pins'"):
        process.apply("torch_group_pin", print)


def test_init_distributed_refuses_a_bad_switch_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import dscore

    monkeypatch.setenv(process.POLICY_ENV, "rendezvous_envs")
    with pytest.raises(ConfigError, match="did you mean 'rendezvous_env'"):
        dscore.init_distributed(dist_backend="gloo")
    assert not dist.is_initialized()


def test_apply_calls_the_action_only_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def action(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "done"

    monkeypatch.setenv(process.POLICY_ENV, "rendezvous_env")
    assert process.apply("rendezvous_env", action, 1, k=2) == "done"
    assert process.apply("exit_drain", action, 3) is None
    assert calls == [((1,), {"k": 2})]
    monkeypatch.setenv(process.POLICY_ENV, "exit_drian")
    with pytest.raises(ConfigError, match="did you mean 'exit_drain'"):
        process.apply("exit_drain", action)
    assert len(calls) == 1


def test_every_policy_is_applied_somewhere_and_every_site_names_a_policy() -> None:
    """Each record has a site (``process.apply("<name>", ...)``) in dscore or a built-in plugin, and no
    ``process.apply`` call names a policy without a record."""
    import ast

    from dscore.env_vars import source_roots

    roots = source_roots()
    applied = process._applied_in(roots)
    assert set(applied) == ALL, f"policies without a site: {sorted(ALL - set(applied))}"
    bad = []
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "apply"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "process"
                    and not (node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in ALL)
                ):
                    bad.append(f"{path}:{node.lineno}")
    assert not bad, bad


def test_import_is_torch_free() -> None:
    code = "import sys, dscore.process, dscore.env_vars; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------- the sites
@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What ``atexit.register`` was called with (nothing is registered for real). The modules under test
    are imported first: torch registers hooks of its own when it is imported."""
    import dscore_plugins.comm.p2p
    import dscore_plugins.comm.shm.bootstrap  # noqa: F401

    seen: list[Any] = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: seen.append(fn) or fn)
    return seen


@pytest.mark.parametrize("setting", ["none", "all"])
def test_group_exit_hook_site(monkeypatch: pytest.MonkeyPatch, registrations: list[Any], setting: str) -> None:
    from dscore.comm.init import ProcessGroupOwner

    monkeypatch.setenv(process.POLICY_ENV, setting)
    owner = ProcessGroupOwner()
    owner.note_adopted()
    owner.note_adopted()  # once per owner, either way
    assert registrations == ([] if setting == "none" else [owner.destroy_at_exit])


@pytest.mark.parametrize("setting", ["none", "all", "torch_group_pins", "exit_drain"])
def test_torch_group_pins_and_exit_drain_sites(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    import dscore.comm.init as init

    calls: list[str] = []
    monkeypatch.setenv(process.POLICY_ENV, setting)
    monkeypatch.delenv("DSCORE_EXIT_DRAIN_S", raising=False)
    monkeypatch.setattr(init, "release_torch_group_pins", lambda: calls.append("pins") or 0)
    monkeypatch.setattr(init, "drain_backend_workers", lambda: calls.append("drain") or True)
    monkeypatch.setattr(init, "flush_pending_sends", lambda: 0)
    owner = init.ProcessGroupOwner()
    owner.destroy_at_exit()  # no group of dscore's: releases the pins, then drains
    want = {"none": [], "all": ["pins", "drain"], "torch_group_pins": ["pins"], "exit_drain": ["drain"]}[setting]
    assert calls == want
    calls.clear()
    monkeypatch.setattr(atexit, "register", lambda fn: fn)
    owner.acquire(type("FakeComm", (), {"owns_group": False})())
    assert calls == (["pins"] if "pins" in want else [])


def test_exit_drain_site_honours_its_own_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    import dscore.comm.init as init

    calls: list[str] = []
    monkeypatch.delenv(process.POLICY_ENV, raising=False)
    monkeypatch.setenv("DSCORE_EXIT_DRAIN_S", "0")
    monkeypatch.setattr(init, "drain_backend_workers", lambda: calls.append("drain") or True)
    monkeypatch.setattr(init, "flush_pending_sends", lambda: 0)
    init.ProcessGroupOwner().destroy_at_exit()
    assert calls == []


@pytest.mark.parametrize("setting", ["none", "all"])
def test_shm_exit_flush_site(monkeypatch: pytest.MonkeyPatch, registrations: list[Any], setting: str) -> None:
    import dscore_plugins.comm.shm.bootstrap as shm

    monkeypatch.setenv(process.POLICY_ENV, setting)
    monkeypatch.setattr(shm, "_flush_registered", False)
    monkeypatch.setattr(shm, "shm_enabled", lambda: True)
    channel = object()
    monkeypatch.setattr(shm, "_set_up", lambda grp, world, rank: channel)

    class Group:
        pass

    grp = Group()
    try:
        assert shm.channel_for(grp, 2, 0) is channel
    finally:
        shm._channels.pop(grp, None)
    assert registrations == ([] if setting == "none" else [shm.flush_pending_sends])


@pytest.mark.parametrize("setting", ["none", "all"])
def test_p2p_exit_flush_site(monkeypatch: pytest.MonkeyPatch, registrations: list[Any], setting: str) -> None:
    import dscore_plugins.comm.p2p as p2p

    monkeypatch.setenv(process.POLICY_ENV, setting)
    monkeypatch.setattr(p2p, "_exit_hook", False)

    class Group:
        pass

    grp = Group()
    work = p2p._PairwiseWork([object()], None, grp, 1)
    del work  # dropped with a transfer pending: kept for the flush
    try:
        assert len(p2p._dropped[grp]) == 1
    finally:
        p2p._dropped.pop(grp, None)
    assert registrations == ([] if setting == "none" else [p2p.flush_dropped])


@pytest.mark.parametrize("setting", ["none", "all"])
def test_malloc_mmap_threshold_site(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """With the policy off, ``mallopt`` is never called (a fake libc records the calls)."""
    import ctypes

    from dscore_plugins.zero import host_memory as stage3  # the policy moved with the stage-3 split

    if not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"):
        pytest.skip("the policy applies to glibc only")
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: ctypes.c_int) -> int:
            calls.append((param, value.value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(stage3, "_malloc_policy_applied", False)
    monkeypatch.setenv(process.POLICY_ENV, setting)
    monkeypatch.setenv("DSCORE_MALLOC_MMAP_THRESHOLD", str(2 << 20))
    got = stage3.apply_host_malloc_policy()
    if setting == "none":
        assert (got, calls) == (0, [])
    else:
        assert got == 2 << 20
        assert calls == [(-3, 2 << 20), (-1, 4 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


_SIGTERM_CHILD = """
import signal
from dscore_plugins.zero import nvme_swap
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
nvme_swap._install_sigterm_cleanup()
print(signal.getsignal(signal.SIGTERM) is nvme_swap._remove_open_folders_then_die)
"""


@pytest.mark.parametrize("setting", ["none", "nvme_sigterm_cleanup"])
def test_nvme_sigterm_cleanup_site(setting: str) -> None:
    env = {**os.environ, process.POLICY_ENV: setting}
    out = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("False" if setting == "none" else "True")


_GROUP_CHILD = """
import atexit, json, os
import torch.distributed as dist
import dscore
from dscore.comm.init import PROCESS_GROUP_OWNER

before = atexit._ncallbacks()
comm = dscore.init_distributed(dist_backend="gloo", verbose=False)
registered = atexit._ncallbacks() - before
import torch.distributed.nn.functional as F  # captures the default group in default arguments
PROCESS_GROUP_OWNER.acquire(comm)
pinned = sum(d is dist.group.WORLD for d in (F.broadcast.__defaults__ or ()))
out = {"registered": registered, "pinned": pinned, "local_rank": os.environ.get("LOCAL_RANK")}
dist.destroy_process_group()
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("setting", ["none", "all"])
def test_group_policies_in_a_real_process(setting: str) -> None:
    """A real one-rank gloo group: with ``none`` no atexit hook of dscore is registered, torch's default
    arguments keep the group (not rebound) and ``LOCAL_RANK`` is not exported; with ``all`` all three happen."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env[process.POLICY_ENV] = setting
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_GROUP_CHILD)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if setting == "none":
        assert got == {"registered": 0, "pinned": 1, "local_rank": None}
    else:
        assert got["registered"] >= 1 and got["pinned"] == 0 and got["local_rank"] == "0"


# ------------------------------------------------------------------------------------------- the report
def test_report_lists_the_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore import env_report

    monkeypatch.setenv(process.POLICY_ENV, "exit_drain")
    item = env_report._probe(env_report._process_policies)
    rows = {r["name"]: r for r in item["value"]}
    assert set(rows) == ALL
    assert rows["exit_drain"]["on"] and not rows["group_exit_hook"]["on"]
    assert rows["group_exit_hook"]["why"] == "not listed in DSCORE_PROCESS_POLICIES=exit_drain"
    assert "DSCORE_EXIT_DRAIN_S" in rows["exit_drain"]["env"]
    monkeypatch.setenv(process.POLICY_ENV, "exit_drian")
    bad = env_report._probe(env_report._process_policies)
    assert bad["value"] is None and "did you mean 'exit_drain'" in bad["error"]


def test_report_json_and_text_show_process_policies() -> None:
    env = {**os.environ, process.POLICY_ENV: "none"}
    cmd = [sys.executable, "-m", "dscore.cli.main", "report"]
    js = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert js.returncode == 0, js.stderr
    rows = json.loads(js.stdout)["process_policies"]["value"]
    assert {r["name"] for r in rows} == ALL and not any(r["on"] for r in rows)
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "process policies" in text.stdout
    assert "nvme_sigterm_cleanup   [OFF]  DSCORE_PROCESS_POLICIES=none" in text.stdout
