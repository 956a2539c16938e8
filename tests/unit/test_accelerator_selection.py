"""Accelerator selection: config, DS_ACCELERATOR, probes in priority order, fake plugins."""

from __future__ import annotations

import logging

import pytest

from dscore import hookimpl
from dscore.accelerator import Accelerator, ProbeResult, select_accelerator
from dscore.errors import AcceleratorError
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import AcceleratorSpec

HERE = __name__


def zero_devices_probe() -> ProbeResult:
    """A vendor package that imports fine but sees no device."""
    return ProbeResult(False, "fakevendor imported but sees 0 devices", 0)


def lying_probe() -> ProbeResult:
    """Claims availability with zero devices: must still be skipped."""
    return ProbeResult(True, "fakevendor says yes", 0)


def exploding_probe() -> ProbeResult:
    raise RuntimeError("driver on fire")


def two_devices_probe() -> ProbeResult:
    return ProbeResult(True, "fakevendor sees 2 device(s)", 2)


class FakeAccelerator(Accelerator):
    name = "fake"
    device_type = "cpu"


class NotAnAccelerator:
    pass


def _plugin(name: str, probe: str, cls: str = "FakeAccelerator", priority: int = 1000) -> object:
    class Plugin:
        @hookimpl
        def dscore_register_accelerators(self) -> list[AcceleratorSpec]:
            return [
                AcceleratorSpec(
                    name=name, device_type="cpu", accelerator=f"{HERE}:{cls}", probe=f"{HERE}:{probe}", priority=priority
                )
            ]

    return Plugin()


def _registry(*extra: tuple[str, object]) -> Registry:
    return Registry(create_plugin_manager(extra_plugins=list(extra)))


def test_auto_detection_picks_cpu_here_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry()
    with caplog.at_level(logging.INFO, logger="dscore.accelerator"):
        acc, reason = select_accelerator(registry, environ={})
    if acc.device_type != "cpu":
        pytest.skip(f"a real accelerator is present: {reason}")
    assert type(acc).__name__ == "CpuAccelerator"
    assert reason.startswith("auto-detected") and "cuda:" in reason
    selected = [r for r in caplog.records if "selected" in r.getMessage()]
    assert len(selected) == 1 and "cpu" in selected[0].getMessage()


def test_ds_accelerator_override() -> None:
    acc, reason = select_accelerator(_registry(), environ={"DS_ACCELERATOR": "CPU"})
    assert acc.device_type == "cpu"
    assert reason.startswith("DS_ACCELERATOR='CPU'")


def test_ds_accelerator_bogus_lists_installed() -> None:
    with pytest.raises(AcceleratorError) as info:
        select_accelerator(_registry(), environ={"DS_ACCELERATOR": "bogus"})
    text = str(info.value)
    assert "DS_ACCELERATOR='bogus' names no installed accelerator" in text
    for name in ("cpu", "cuda", "hpu", "mps", "npu", "xpu"):
        assert name in text


def test_ds_accelerator_typo_gets_a_suggestion() -> None:
    with pytest.raises(AcceleratorError, match="Did you mean 'cuda'"):
        select_accelerator(_registry(), environ={"DS_ACCELERATOR": "cdua"})


def test_config_wins_over_environment() -> None:
    acc, reason = select_accelerator(_registry(), requested="cpu", environ={"DS_ACCELERATOR": "bogus"})
    assert acc.device_type == "cpu" and reason.startswith("accelerator='cpu'")


def test_requested_but_unusable_is_an_error_with_the_probe_reason() -> None:
    registry = _registry(("fakevendor", _plugin("fakeacc", "zero_devices_probe")))
    with pytest.raises(AcceleratorError) as info:
        select_accelerator(registry, environ={"DS_ACCELERATOR": "fakeacc"})
    assert "not usable here: fakevendor imported but sees 0 devices" in str(info.value)
    assert "Usable here: cpu" in str(info.value)


@pytest.mark.parametrize("probe", ["zero_devices_probe", "lying_probe", "exploding_probe"])
def test_fake_accelerator_without_devices_is_skipped(probe: str) -> None:
    registry = _registry(("fakevendor", _plugin("fakeacc", probe)))
    acc, reason = select_accelerator(registry, environ={})
    assert acc.device_type == "cpu" and not isinstance(acc, FakeAccelerator)
    assert "fakeacc:" in reason
    if probe == "exploding_probe":
        assert "driver on fire" in reason


def test_available_fake_accelerator_with_higher_priority_wins() -> None:
    registry = _registry(("fakevendor", _plugin("fakeacc", "two_devices_probe")))
    acc, reason = select_accelerator(registry, environ={})
    assert isinstance(acc, FakeAccelerator)
    assert "fakevendor sees 2 device(s)" in reason


def test_lower_priority_than_cpu_never_wins() -> None:
    registry = _registry(("fakevendor", _plugin("fakeacc", "two_devices_probe", priority=-5)))
    acc, _ = select_accelerator(registry, environ={})
    assert acc.device_type == "cpu" and not isinstance(acc, FakeAccelerator)


def test_accelerator_class_must_subclass_accelerator() -> None:
    registry = _registry(("fakevendor", _plugin("fakeacc", "two_devices_probe", cls="NotAnAccelerator")))
    with pytest.raises(AcceleratorError, match="not a dscore.accelerator.Accelerator subclass"):
        select_accelerator(registry, requested="fakeacc", environ={})


FAKE_MANIFEST = """
from dscore import hookimpl
from dscore.accelerator import Accelerator, ProbeResult
from dscore.specs import AcceleratorSpec


class ZeroAccelerator(Accelerator):
    name = "zeroacc"
    device_type = "cpu"


def probe():
    return ProbeResult(False, "zeroacc vendor package imported, 0 devices", 0)


@hookimpl
def dscore_register_accelerators():
    return [AcceleratorSpec(name="zeroacc", device_type="cpu", priority=500,
                            accelerator="dscore_fake_zeroacc:ZeroAccelerator", probe="dscore_fake_zeroacc:probe")]
"""


def test_installed_fake_accelerator_with_zero_devices_is_skipped(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    (tmp_path / "dscore_fake_zeroacc.py").write_text(FAKE_MANIFEST)
    info = tmp_path / "dscore_fake_zeroacc-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dscore-fake-zeroacc\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dscore]\nzeroacc = dscore_fake_zeroacc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        manager = create_plugin_manager()
        record = manager.records["zeroacc"]
        assert record.status == "active" and record.distribution == "dscore-fake-zeroacc"
        acc, reason = select_accelerator(Registry(manager), environ={})
        assert type(acc).__name__ != "ZeroAccelerator"
        assert "zeroacc: zeroacc vendor package imported, 0 devices" in reason
    finally:
        sys.modules.pop("dscore_fake_zeroacc", None)
