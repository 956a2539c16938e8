"""Discovery against real metadata: fake distributions on sys.path (good, broken, conflicting,
disabled, misspelled hook, duplicate entry-point names, autoload off)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fakedist import write_distribution

from dscore.errors import (
    ComponentNotFoundError,
    PluginConflictError,
    PluginError,
    PluginLoadError,
    PluginValidationError,
)
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry

GOOD = """
from dscore import hookimpl
from dscore.specs import OptimizerSpec

@hookimpl
def dscore_register_optimizers():
    return [OptimizerSpec(name="{name}", aliases=({alias!r},), factory="torch.optim:SGD")]
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for mod in [m for m in sys.modules if m.startswith("fakeplug_")]:
        del sys.modules[mod]


def test_builtins_are_listed_first_and_marked_builtin(site: Path) -> None:
    write_distribution(site, "aaa-first", "1.0", {"aaa": "fakeplug_aaa"}, {"fakeplug_aaa": GOOD.format(name="AaaOpt", alias="aaa_opt")})
    manager = create_plugin_manager()
    records = list(manager.records.values())
    builtin_flags = [r.builtin for r in records]
    assert builtin_flags == sorted(builtin_flags, reverse=True), "built-ins must come before third-party plugins"
    third = manager.records["aaa"]
    assert (third.builtin, third.distribution, third.version, third.status) == (False, "aaa-first", "1.0", "active")
    assert third.provides == {"optimizer": ["AaaOpt"]}


def test_lookup_is_case_insensitive_with_aliases(site: Path) -> None:
    write_distribution(site, "dscore-fake-good", "2.3", {"good": "fakeplug_good"}, {"fakeplug_good": GOOD.format(name="MyAdam", alias="my_adam")})
    registry = Registry(create_plugin_manager())
    assert registry.get("optimizer", "myadam").name == "MyAdam"
    assert registry.get("optimizer", "MY_ADAM").name == "MyAdam"
    assert registry.provider(registry.get("optimizer", "MyAdam")).distribution == "dscore-fake-good"


def test_broken_import_is_listed_not_fatal(site: Path) -> None:
    write_distribution(site, "dscore-fake-broken", "0.1", {"broken": "fakeplug_broken"}, {"fakeplug_broken": "raise ImportError('needs libfoo 2')\n"})
    manager = create_plugin_manager()
    record = manager.records["broken"]
    assert record.status == "broken"
    assert "needs libfoo 2" in record.error and "\n" not in record.error
    # a component that is not found while a plugin is broken points at the broken plugin
    with pytest.raises(PluginLoadError, match=r"broken \(dscore-fake-broken 0.1\).*needs libfoo 2"):
        Registry(manager).get("optimizer", "FooAdam", config_path="optimizer.type")


def test_conflict_names_every_provider_and_how_to_disable(site: Path) -> None:
    write_distribution(site, "dscore-fake-a", "1.0", {"fake_a": "fakeplug_a"}, {"fakeplug_a": GOOD.format(name="Shared", alias="shared_a")})
    write_distribution(site, "dscore-fake-b", "2.0", {"fake_b": "fakeplug_b"}, {"fakeplug_b": GOOD.format(name="shared", alias="shared_b")})
    registry = Registry(create_plugin_manager())
    with pytest.raises(PluginConflictError) as info:
        registry.get("optimizer", "SHARED")
    text = str(info.value)
    for part in ("fake_a (dscore-fake-a 1.0)", "fake_b (dscore-fake-b 2.0)", "DSCORE_DISABLE_PLUGINS="):
        assert part in text
    assert registry.get("optimizer", "shared_b").name == "shared"  # unambiguous aliases still work
    assert [(k, n) for k, n, _ in registry.conflicts()] == [("optimizer", "shared")]


def test_disabled_by_env_and_by_argument(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_distribution(site, "dscore-fake-a", "1.0", {"fake_a": "fakeplug_a"}, {"fakeplug_a": GOOD.format(name="OnlyA", alias="only_a")})
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "fake_a")
    manager = create_plugin_manager()
    assert manager.records["fake_a"].status == "disabled"
    with pytest.raises(ComponentNotFoundError) as info:
        Registry(manager).get("optimizer", "only_A")
    text = str(info.value)
    assert "installed plugin fake_a (dscore-fake-a 1.0), which is disabled" in text
    assert "remove fake_a from DSCORE_DISABLE_PLUGINS" in text and "may not be installed" not in text
    with pytest.raises(ComponentNotFoundError, match="no optimizer named 'Nothing' is installed.*may not be installed"):
        Registry(manager).get("optimizer", "Nothing")
    monkeypatch.delenv("DSCORE_DISABLE_PLUGINS")
    assert create_plugin_manager(disable=["FAKE_A"]).records["fake_a"].status == "disabled"


def test_cpu_accelerator_cannot_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "cpu")
    with pytest.raises(PluginError, match="cpu accelerator is essential"):
        create_plugin_manager()


def test_autoload_off_keeps_builtins_and_named_plugins(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_distribution(site, "dscore-fake-a", "1.0", {"fake_a": "fakeplug_a"}, {"fakeplug_a": GOOD.format(name="OptA", alias="opt_a")})
    write_distribution(site, "dscore-fake-b", "1.0", {"fake_b": "fakeplug_b"}, {"fakeplug_b": GOOD.format(name="OptB", alias="opt_b")})
    monkeypatch.setenv("DSCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("DSCORE_PLUGINS", "fake_b")
    manager = create_plugin_manager()
    assert manager.records["fake_a"].status == "disabled"
    assert manager.records["fake_b"].status == "active"
    assert all(r.status != "disabled" for r in manager.records.values() if r.builtin)


def test_misspelled_hook_is_broken_and_fails_at_start(site: Path) -> None:
    source = """
    from dscore import hookimpl

    @hookimpl
    def dscore_register_optimizer():
        return []
    """
    write_distribution(site, "dscore-fake-typo", "0.3", {"typo": "fakeplug_typo"}, {"fakeplug_typo": source})
    manager = create_plugin_manager()
    record = manager.records["typo"]
    assert record.status == "broken"
    assert "dscore_register_optimizer" in record.error and "did you mean 'dscore_register_optimizers'" in record.error
    with pytest.raises(PluginValidationError, match=r"typo \(dscore-fake-typo 0.3\).*DSCORE_DISABLE_PLUGINS=typo"):
        manager.check_healthy()


def test_registration_returning_wrong_type_is_broken(site: Path) -> None:
    source = """
    from dscore import hookimpl

    @hookimpl
    def dscore_register_optimizers():
        return ["adam"]
    """
    write_distribution(site, "dscore-fake-wrong", "0.1", {"wrong": "fakeplug_wrong"}, {"fakeplug_wrong": source})
    record = create_plugin_manager().records["wrong"]
    assert record.status == "broken" and "expected OptimizerSpec" in record.error


def test_same_entry_point_name_from_two_distributions(site: Path) -> None:
    write_distribution(site, "dscore-fake-one", "1.0", {"twin": "fakeplug_one"}, {"fakeplug_one": GOOD.format(name="One", alias="one")})
    write_distribution(site, "dscore-fake-two", "1.0", {"twin": "fakeplug_two"}, {"fakeplug_two": GOOD.format(name="Two", alias="two")})
    manager = create_plugin_manager()
    twins = [r for r in manager.records.values() if r.name == "twin"]
    assert len(twins) == 2
    assert sorted(r.status for r in twins) == ["active", "broken"]
    broken = next(r for r in twins if r.status == "broken")
    assert "already used by twin (dscore-fake-one 1.0)" in broken.error


def test_fingerprint_changes_with_plugin_set(site: Path) -> None:
    before = create_plugin_manager().fingerprint()
    assert create_plugin_manager().fingerprint() == before
    write_distribution(site, "dscore-fake-fp", "1.0", {"fp": "fakeplug_fp"}, {"fakeplug_fp": GOOD.format(name="Fp", alias="fp_opt")})
    assert create_plugin_manager().fingerprint() != before
