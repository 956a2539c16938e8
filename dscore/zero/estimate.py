"""Memory estimates of a model's states under ZeRO stages 2 and 3 (DeepSpeed 0.19.8's estimators).

The byte counts per parameter are DeepSpeed's documented rule of thumb for mixed precision with Adam:
2 bytes for the 16-bit weights, 2 for 16-bit gradients, 4 + 4 for fp32 weights and gradients and 8 for the
two fp32 moments (18 bytes partitioned), 4 bytes per element of the largest layer for gathering it under
stage 3; host-side buffers are scaled by ``additional_buffer_factor``. All results are bytes (ints). The
``*_all_live`` / ``*_all_cold`` functions print the per-option table DeepSpeed prints (GiB, per CPU and per
GPU) and return its rows.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_params_for_estimate",
]


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """ZeRO-3 memory per host and per device, in bytes.

    Args:
        total_params: parameters of the model (elements).
        largest_layer_params: parameters of its largest module (its own, not its children's).
        cpu_offload / cpu_offload_params: optimizer state / parameters offloaded to the host.
        zero_init: the model is built inside ``zero.Init`` (never whole on one host).

    Returns:
        ``(cpu_bytes, gpu_bytes, largest_layer_bytes)``.
    """
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = largest
        host_per_param = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        cpu = total_params * host_per_param * additional_buffer_factor
    elif cpu_offload:
        gpu = largest + int(2 * total_params / total_gpus)
        host_per_param = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        cpu = total_params * host_per_param * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        built = largest_layer_params if zero_init else total_params
        cpu = built * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """ZeRO-2 memory per host and per device, in bytes: ``(cpu_bytes, gpu_bytes)`` (see the module docstring)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def model_params_for_estimate(model: Any) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` of a ``torch.nn.Module``: a parameter shared by several
    modules counts once in the total; a layer's count is its own parameters (not its children's)."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return int(total), int(largest)


def _header(num_nodes: int, num_gpus_per_node: int, model_line: str) -> None:
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {'nodes' if num_nodes > 1 else 'node'}, {num_gpus_per_node} "
          f"{'GPUs' if num_gpus_per_node > 1 else 'GPU'} per node.\n{model_line}")
    print("  per CPU  |  per GPU |   Options")


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[tuple[int, int, str]]:
    """Print the ZeRO-3 estimate of every offload/``zero_init`` option; returns ``(cpu_bytes, gpu_bytes,
    options)`` per printed row."""
    _header(num_nodes, num_gpus_per_node, f"SW: Model with {int(total_params / 1e6)}M total params, "
            f"{int(largest_layer_params / 1e6)}M largest layer params.")
    rows = []
    for offload, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, offload, offload_params,
                zero_init, additional_buffer_factor)
            options = (f"offload_param={'cpu ' if offload_params else 'none'}, "
                       f"offload_optimizer={'cpu ' if offload else 'none'}, zero_init={int(zero_init)}")
            print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")
            rows.append((cpu, gpu, options))
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model: Any, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[tuple[int, int, str]]:
    """:func:`estimate_zero3_model_states_mem_needs_all_cold` for a built ``torch.nn.Module``."""
    total, largest = model_params_for_estimate(model)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[tuple[int, int, str]]:
    """Print the ZeRO-2 estimate with and without optimizer offload; returns the printed rows."""
    _header(num_nodes, num_gpus_per_node, f"SW: Model with {int(total_params / 1e6)}M total params.")
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                         additional_buffer_factor)
        options = f"offload_optimizer={'cpu ' if offload else 'none'}"
        print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")
        rows.append((cpu, gpu, options))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model: Any, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[tuple[int, int, str]]:
    """:func:`estimate_zero2_model_states_mem_needs_all_cold` for a built ``torch.nn.Module``."""
    total, _ = model_params_for_estimate(model)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)
