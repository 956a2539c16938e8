"""Accelerator and comm-backend manifests: registered through entry points, listed without torch."""

from __future__ import annotations

import json
import subprocess
import sys

from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import AcceleratorSpec, CommBackendSpec

ACCELERATORS = {"cpu", "cuda", "xpu", "hpu", "npu", "mps"}
BACKENDS = {"gloo", "nccl", "ccl", "xccl", "hccl", "mpi"}


def test_every_builtin_accelerator_and_backend_is_registered() -> None:
    registry = Registry(create_plugin_manager())
    assert ACCELERATORS <= set(registry.names("accelerator"))
    assert BACKENDS <= set(registry.names("comm_backend"))
    for name in ACCELERATORS:
        spec = registry.get_typed(AcceleratorSpec, name)
        assert spec.device_type == name and spec.probe.endswith(".plugin:probe")
        assert spec.accelerator.startswith(f"dscore_accelerators.{name}.accelerator:")
    priorities = {name: registry.get_typed(AcceleratorSpec, name).priority for name in ACCELERATORS}
    assert min(priorities, key=priorities.__getitem__) == "cpu"
    assert registry.get_typed(CommBackendSpec, "nccl").device_types == ("cuda",)
    assert "cpu" in registry.get_typed(CommBackendSpec, "gloo").device_types
    assert registry.get_typed(CommBackendSpec, "ccl").requires == ("oneccl_bindings_for_pytorch",)
    assert registry.get_typed(AcceleratorSpec, "GPU").name == "cuda"  # alias, case-insensitive


def test_accelerator_classes_follow_the_base_class() -> None:
    from dscore.accelerator import Accelerator
    from dscore.specs import resolve

    registry = Registry(create_plugin_manager())
    for name in ACCELERATORS:
        cls = resolve(registry.get_typed(AcceleratorSpec, name).accelerator)
        assert issubclass(cls, Accelerator) and cls.device_type == name
        assert cls.__name__ == f"{name.capitalize()}Accelerator"


def test_plugins_list_shows_them_without_importing_torch() -> None:
    code = (
        "import io, json, sys, contextlib\n"
        "from dscore.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['plugins', 'list', '--json'])\n"
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'out': json.loads(buf.getvalue())}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0
    assert result["torch"] is False, "dscore plugins list imported torch"
    provided = {}
    for record in result["out"]:
        for kind, names in record["provides"].items():
            provided.setdefault(kind, set()).update(names)
    assert ACCELERATORS <= provided["accelerator"]
    assert BACKENDS <= provided["comm_backend"]


def test_core_accelerator_and_comm_modules_stay_torch_free() -> None:
    code = (
        "import sys\n"
        "import dscore.accelerator, dscore.comm, dscore.comm.env, dscore.runtime.context\n"
        "import dscore_accelerators.cpu.plugin, dscore_accelerators.cuda.plugin, dscore_plugins.comm.plugin\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "False"
