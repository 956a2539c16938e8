"""``deepspeed.ops.op_builder``: DeepSpeed 0.19.8's op-builder classes, answered by dscore's op builders.

Every builder class DeepSpeed 0.19.8 ships (CUDA and CPU directories) is here with its ``NAME`` and
``BUILD_VAR``; see :class:`~deepspeed.ops.op_builder.builder.OpBuilder` for how each reports and builds
through dscore's registry. Those dscore registers (``cpu_adam``, ``cpu_adagrad``, ``cpu_lion``,
``fused_adam``, ``fused_lamb``, ``fused_lion``, ``async_io``) build; the others report
``is_compatible() == False`` and refuse ``load()``. ``ALL_OPS`` maps each op name to a builder instance.
"""

from __future__ import annotations

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder, TorchCPUOpBuilder

# (class name, NAME, BUILD_VAR, base) of DeepSpeed 0.19.8's builders
_BUILDERS = (
    ("AsyncIOBuilder", "async_io", "DS_BUILD_AIO", CUDAOpBuilder),
    ("CCLCommBuilder", "deepspeed_ccl_comm", "DS_BUILD_CCL_COMM", TorchCPUOpBuilder),
    ("CPUAdagradBuilder", "cpu_adagrad", "DS_BUILD_CPU_ADAGRAD", TorchCPUOpBuilder),
    ("CPUAdamBuilder", "cpu_adam", "DS_BUILD_CPU_ADAM", TorchCPUOpBuilder),
    ("CPULionBuilder", "cpu_lion", "DS_BUILD_CPU_LION", TorchCPUOpBuilder),
    ("DeepCompileBuilder", "dc", "DS_BUILD_DEEP_COMPILE", CUDAOpBuilder),
    ("EvoformerAttnBuilder", "evoformer_attn", "DS_BUILD_EVOFORMER_ATTN", CUDAOpBuilder),
    ("FPQuantizerBuilder", "fp_quantizer", "DS_BUILD_FP_QUANTIZER", CUDAOpBuilder),
    ("FusedAdamBuilder", "fused_adam", "DS_BUILD_FUSED_ADAM", CUDAOpBuilder),
    ("FusedLambBuilder", "fused_lamb", "DS_BUILD_FUSED_LAMB", CUDAOpBuilder),
    ("FusedLionBuilder", "fused_lion", "DS_BUILD_FUSED_LION", CUDAOpBuilder),
    ("GDSBuilder", "gds", "DS_BUILD_GDS", CUDAOpBuilder),
    ("InferenceBuilder", "transformer_inference", "DS_BUILD_TRANSFORMER_INFERENCE", CUDAOpBuilder),
    ("InferenceCoreBuilder", "inference_core_ops", "DS_BUILD_INFERENCE_CORE_OPS", CUDAOpBuilder),
    ("InferenceCutlassBuilder", "cutlass_ops", "DS_BUILD_CUTLASS_OPS", CUDAOpBuilder),
    ("NotImplementedBuilder", "deepspeed_not_implemented", "DS_BUILD_NOT_IMPLEMENTED", TorchCPUOpBuilder),
    ("PinMemoryBuilder", "pin_memory", "DS_BUILD_PIN_MEMORY", OpBuilder),
    ("QuantizerBuilder", "quantizer", "DS_BUILD_QUANTIZER", CUDAOpBuilder),
    ("RaggedOpsBuilder", "ragged_device_ops", "DS_BUILD_RAGGED_DEVICE_OPS", CUDAOpBuilder),
    ("RaggedUtilsBuilder", "ragged_ops", "DS_BUILD_RAGGED_OPS", CUDAOpBuilder),
    ("RandomLTDBuilder", "random_ltd", "DS_BUILD_RANDOM_LTD", CUDAOpBuilder),
    ("ShareMemCommBuilder", "deepspeed_shm_comm", "DS_BUILD_SHM_COMM", TorchCPUOpBuilder),
    ("SpatialInferenceBuilder", "spatial_inference", "DS_BUILD_SPATIAL_INFERENCE", CUDAOpBuilder),
    ("StochasticTransformerBuilder", "stochastic_transformer", "DS_BUILD_STOCHASTIC_TRANSFORMER", CUDAOpBuilder),
    ("TransformerBuilder", "transformer", "DS_BUILD_TRANSFORMER", CUDAOpBuilder),
    ("UtilsBuilder", "utils", "DS_BUILD_UTILS", OpBuilder),
)

for _cls_name, _name, _var, _base in _BUILDERS:
    globals()[_cls_name] = type(_cls_name, (_base,), {
        "NAME": _name, "BUILD_VAR": _var, "__module__": __name__,
        "__doc__": f"DeepSpeed's ``{_name}`` op builder ({_var}), answered by dscore's op builder of that name.",
    })
del _cls_name, _name, _var, _base

__all__ = ["ALL_OPS", "CUDAOpBuilder", "OpBuilder", "TorchCPUOpBuilder", *(b[0] for b in _BUILDERS)]


def __getattr__(name: str) -> object:
    if name == "ALL_OPS":  # instances made on first use (DeepSpeed builds them at import)
        ops = {cls_name_op[1]: globals()[cls_name_op[0]]() for cls_name_op in _BUILDERS}
        globals()["ALL_OPS"] = ops
        return ops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
