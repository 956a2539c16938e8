"""Thin user-facing names (dscore.exports): resolved through a unit's exports module by kind and name, with the
registry's errors when the unit is disabled or missing."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from fakedist import write_distribution

from dscore.errors import ComponentNotFoundError
from dscore.exports import provided, thin_getattr

MANIFEST = """
from dscore import hookimpl
from dscore.specs import ModelTransformSpec

@hookimpl
def dscore_register_model_transforms():
    return [ModelTransformSpec(name="fake_tx", transform="fakeexp_impl:TRANSFORM", exports="fakeexp_impl")]
"""
IMPL = """
TRANSFORM = object()
class Thing:
    value = 42
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    write_distribution(root, "dscore-fake-exports", "1.0", {"fake_exports": "fakeexp_manifest"},
                       {"fakeexp_manifest": MANIFEST, "fakeexp_impl": IMPL})
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("DSCORE_DISABLE_PLUGINS", raising=False)
    return root


def test_a_thin_name_resolves_through_the_unit_and_is_kept(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_public")
    module.__getattr__ = thin_getattr("fake_public", "model_transform", "fake_tx", ["Thing"])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_public", module)
    assert module.Thing.value == 42
    assert "Thing" in vars(module)  # later accesses are plain lookups
    with pytest.raises(AttributeError, match="no attribute 'Other'"):
        module.Other  # noqa: B018


def test_a_disabled_unit_is_named_with_how_to_re_enable_it(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "model_transform:fake_tx")
    with pytest.raises(ComponentNotFoundError) as err:
        provided("model_transform", "fake_tx", "Thing", public_name="fake_public.Thing")
    assert "model_transform:fake_tx" in str(err.value) and "fake_public.Thing" in str(err.value)


def test_a_missing_attribute_names_the_unit(site: Path) -> None:
    with pytest.raises(AttributeError, match="fake_tx"):
        provided("model_transform", "fake_tx", "Nope")
