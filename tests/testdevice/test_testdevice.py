"""The test device itself and NCCL's rules (examples/plugins/dscore-testdevice), plus the host-sync and
timer defects of issue 28 measured on it. Each check runs in spawned processes (activating the device
renames torch's PrivateUse1 backend process-wide)."""

from __future__ import annotations

from typing import Any

import pytest
import testdevice_checks as checks

from dscore.testing import run_distributed


@pytest.fixture(scope="module")
def semantics() -> dict[str, Any]:
    return run_distributed(checks.device_semantics, 1, init_process_group=False, timeout=600)[0]


def test_device_is_not_the_host(semantics: dict[str, Any]) -> None:
    s = semantics
    assert s["device"] == "testdev:0" and s["is_cpu"] is False
    assert s["roundtrip_equal"] and s["strided_copy_equal"] and s["view_inplace_equal"]
    assert "Expected all tensors to be on the same device" in s["mix_host_error"], s["mix_host_error"]
    assert "testdev:1" in s["mix_index_error"], s["mix_index_error"]
    assert s["mix_host_scalar_ok"], "a 0-dim CPU tensor is accepted with device tensors, as on CUDA"
    assert s["numpy_error"], "a device tensor cannot be viewed as numpy"
    assert s["grad_device"] == "testdev:0"


def test_allocator_pinning_streams_events_and_counters(semantics: dict[str, Any]) -> None:
    s = semantics
    assert s["memory_allocated_delta"] == 1 << 20 and s["memory_after_free_delta"] == 0
    assert s["pinned"], "pin_memory() goes through the device's pinned allocator; plain host memory is not pinned"
    assert s["new_stream_differs"]
    assert s["event_elapsed_ms"] >= 0.0
    assert s["scalar_reads_counted"] == 1


def test_registered_as_a_third_party_accelerator(semantics: dict[str, Any]) -> None:
    name, device_type, backend, device = semantics["accelerator"]
    assert (name, device_type, backend, device) == ("testdev", "testdev", "testnccl", "testdev:0")
    assert "DS_ACCELERATOR" in semantics["accelerator_reason"]


def test_moving_a_model_keeps_tied_parameters(semantics: dict[str, Any]) -> None:
    """Found by the test device: torch's Module.to builds new Parameters on an out-of-tree device (tied
    weights come apart); dscore's placement keeps every Parameter object."""
    assert semantics["ties"] == {"torch_to": False, "to_module": True, "same_parameter": True,
                                 "where": "testdev:0/torch.bfloat16"}, semantics["ties"]


def test_host_tensor_is_pinned_in_one_allocation(semantics: dict[str, Any]) -> None:
    """Defect 7: host_tensor zero-filled a plain buffer and copied it into pinned memory (twice the peak)."""
    h = semantics["host_tensor"]
    assert h == {"pinned": True, "zero": True, "copies": [], "device": "cpu"}, h


@pytest.mark.slow
def test_nccl_rules() -> None:
    res = run_distributed(checks.nccl_rules, 2, init_process_group=False, timeout=600)
    for r, out in enumerate(res):
        assert out["backend"] == "testnccl"
        for key, call in (("host_all_reduce", "all_reduce"), ("host_broadcast", "broadcast"),
                          ("host_all_gather", "all_gather_into_tensor"), ("host_send", "send")):
            assert f"testnccl.{call}" in out[key] and "cpu tensor" in out[key], out[key]
        assert "current device" in out["other_device"], out["other_device"]
        assert out["before_wait"] == [float(r + 1)] * 4, "results land only when the work is waited for"
        assert out["after_wait"] == [3.0] * 4
        assert out["avg"] == [1.5, 1.5]
        assert out["all_gather"] == [3.0] * 8
        assert out["reduce_scatter"] == ([0.0, 2.0] if r == 0 else [4.0, 6.0])
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
    assert res[1]["p2p_order"] == [[1.0, 1.0], [2.0, 2.0]], "tags are ignored: first posted, first received"


@pytest.mark.slow
def test_no_host_sync_in_clipping_and_timers_synchronize_the_device() -> None:
    """Defect 1 (the norm all-reduced on the device even for host partitions) and defect 7 (no
    ``float(norm)`` host sync without overflow checking; sub-phase timers synchronize the device)."""
    res = run_distributed(checks.syncs_and_timers, 2, init_process_group=False, timeout=600)
    for out in res:
        assert out["backend"] == "testnccl"
        assert out["unscale_clip_scalar_reads"] == 0, out
        assert out["scalar_reads_per_step"] == 0, "a clipped fp32 ZeRO-2 step needs no host sync"
        assert out["norm_device"].startswith("testdev") and out["host_norm_device"].startswith("testdev"), out
        # the engine's own step timer syncs twice; every sub-phase boundary read adds one
        assert out["step_subphases"] == ["step.allgather", "step.clip", "step.optimizer"], out
        assert out["step_syncs"] >= 2 + len(out["step_subphases"]) + 1, out


def test_pipeline_links_check_the_order_instead_of_relying_on_tags() -> None:
    """Defect 5: messages between two stages are matched in posting order (NCCL has no tags); a link asked
    to receive micro-batch 1 before 0 must refuse instead of silently taking micro-batch 0's tensors."""
    import torch

    from dscore.pipe import PipelineError
    from dscore_plugins.engine.pipe.p2p import P2PLink

    class Recorder:
        def __init__(self) -> None:
            self.tags: list[int] = []

        def send(self, tensor: Any, dst: int, *, tag: int = 0, group: Any = None) -> None:
            self.tags.append(tag)

        def recv(self, tensor: Any, src: int, *, tag: int = 0, group: Any = None) -> None:
            self.tags.append(tag)

        def isend(self, tensor: Any, dst: int, *, tag: int = 0, group: Any = None) -> Any:
            self.tags.append(tag)
            return None

    comm = Recorder()
    link = P2PLink(1, torch.device("cpu"), comm)  # type: ignore[arg-type]
    link.recv_meta = [(torch.float32, (2,), True)]
    with pytest.raises(PipelineError, match="micro-batch 1, but the next one in order is 0"):
        link.recv_activations(1, requires_grad=True)
    link.recv_activations(0, requires_grad=True)
    link.recv_activations(1, requires_grad=True)
    link.send_activations((torch.ones(2, requires_grad=True),), 0, "stage 0")
    assert set(comm.tags) == {0}, f"no tags on the wire, got {sorted(set(comm.tags))}"


def test_no_direct_torch_cuda_outside_cuda_code() -> None:
    """Defect 7: deep code asks the accelerator; ``torch.cuda`` appears only in CUDA-specific code."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    allowed = {
        "accelerators/dscore_accelerators/cuda/accelerator.py", "accelerators/dscore_accelerators/cuda/plugin.py",
        "dscore/ops/builder.py",  # CUDAOpBuilder: the CUDA toolchain itself
        "dscore/env_report.py",  # `dscore report` prints what torch.cuda sees
        "dscore/accelerator/base.py",  # docstrings naming torch.cuda as the example device module
    }
    offenders = []
    for tree in ("dscore", "plugins", "accelerators"):
        for path in (root / tree).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if rel in allowed:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"\btorch\.cuda\.", code) and '"""' not in code and "``" not in code:
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
