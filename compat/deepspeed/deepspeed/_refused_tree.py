"""Whole subpackages of DeepSpeed 0.19.8 whose feature dscore does not have: importable, refused when used.

:data:`REFUSED_TREES` lists each such subtree with the reason given to its users and the dotted names of its
submodules in DeepSpeed 0.19.8's installed layout (a fact of that release: ``import deepspeed.inference.v2``
works, a name that release does not have still raises ``ModuleNotFoundError``). :class:`RefusedTreeFinder`
(appended to ``sys.meta_path`` by ``import deepspeed``, so a real module of this distribution always wins)
makes each listed module on import: an empty module whose every public attribute is a
:func:`deepspeed._not_provided.not_provided` stand-in raising :class:`~deepspeed._not_provided.NotProvidedError`
with the subtree's reason when used. Nothing is refused at import, so one missing feature does not take a whole
test file or client module down.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["REFUSED_TREES", "RefusedTreeFinder", "install", "refused_reason"]

_INFERENCE = "dscore has no inference engine (DeepSpeed-Inference, its v2 ragged engine, kernel injection and inference quantization): dscore trains models; generation inside training is DeepSpeed's hybrid engine (the `hybrid_engine` config block, deepspeed.runtime.hybrid_engine)"

_UNIVERSAL = (
    "dscore has no universal-checkpoint format; a DeepSpeed checkpoint loads directly at another world size or ZeRO "
    "stage (engine.load_checkpoint), and 'dscore checkpoint export DIR --fp32 OUT' consolidates one"
)

_SWAP = (
    "DeepSpeed's ZeRO-Infinity swapper classes are internal to its ZeRO stage 3; dscore's NVMe offload is the "
    '`offload_param` / `offload_optimizer` `"device": "nvme"` config (deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES is provided)'
)

#: subtree root -> (reason, its submodules relative to the root, as in DeepSpeed 0.19.8's wheel)
REFUSED_TREES: dict[str, tuple[str, tuple[str, ...]]] = {
    # DeepSpeed's universal-checkpoint tooling (single modules of the real package deepspeed.checkpoint)
    'deepspeed.checkpoint.autoep_universal': (_UNIVERSAL, ()),
    'deepspeed.checkpoint.ds_to_universal': (_UNIVERSAL, ()),
    'deepspeed.checkpoint.universal_checkpoint': (_UNIVERSAL, ()),
    'deepspeed.autotuning': (
        "DeepSpeed's autotuner is not provided",
        (
            'autotuner', 'config', 'constants', 'scheduler', 'tuner', 'tuner.base_tuner', 'tuner.cost_model',
            'tuner.index_based_tuner', 'tuner.model_based_tuner', 'tuner.utils', 'utils'
        ),
    ),
    'deepspeed.compression': (
        "DeepSpeed's compression library (quantization-aware training, pruning, layer reduction) is not provided",
        ('helper',),
    ),
    'deepspeed.inference': (
        _INFERENCE,
        (
            'config', 'engine', 'quantization', 'quantization.layers', 'quantization.quantization',
            'quantization.quantization_context', 'quantization.utils', 'v2', 'v2.allocator', 'v2.checkpoint',
            'v2.checkpoint.base_engine', 'v2.checkpoint.huggingface_engine', 'v2.checkpoint.in_memory_engine',
            'v2.config_v2', 'v2.engine_factory', 'v2.engine_v2', 'v2.inference_parameter', 'v2.inference_utils',
            'v2.kernels', 'v2.kernels.core_ops', 'v2.kernels.core_ops.bias_activations',
            'v2.kernels.core_ops.bias_activations.bias_activation', 'v2.kernels.core_ops.blas_kernels',
            'v2.kernels.core_ops.blas_kernels.blas_linear', 'v2.kernels.core_ops.cuda_layer_norm',
            'v2.kernels.core_ops.cuda_layer_norm.cuda_fp_ln_base', 'v2.kernels.core_ops.cuda_layer_norm.cuda_ln',
            'v2.kernels.core_ops.cuda_layer_norm.cuda_post_ln', 'v2.kernels.core_ops.cuda_layer_norm.cuda_pre_ln',
            'v2.kernels.core_ops.cuda_linear', 'v2.kernels.core_ops.cuda_linear.cuda_linear',
            'v2.kernels.core_ops.cuda_rms_norm', 'v2.kernels.core_ops.cuda_rms_norm.rms_norm',
            'v2.kernels.core_ops.cuda_rms_norm.rms_norm_base', 'v2.kernels.core_ops.cuda_rms_norm.rms_pre_norm',
            'v2.kernels.core_ops.gated_activations', 'v2.kernels.core_ops.gated_activations.gated_activation',
            'v2.kernels.cutlass_ops', 'v2.kernels.cutlass_ops.mixed_gemm',
            'v2.kernels.cutlass_ops.mixed_gemm.mixed_gemm', 'v2.kernels.cutlass_ops.moe_gemm',
            'v2.kernels.cutlass_ops.moe_gemm.mixed_moe_gemm', 'v2.kernels.cutlass_ops.moe_gemm.moe_gemm',
            'v2.kernels.ds_kernel', 'v2.kernels.ragged_ops', 'v2.kernels.ragged_ops.atom_builder',
            'v2.kernels.ragged_ops.atom_builder.atom_builder', 'v2.kernels.ragged_ops.blocked_flash',
            'v2.kernels.ragged_ops.blocked_flash.blocked_flash', 'v2.kernels.ragged_ops.embed',
            'v2.kernels.ragged_ops.embed.embed', 'v2.kernels.ragged_ops.linear_blocked_kv_rotary',
            'v2.kernels.ragged_ops.linear_blocked_kv_rotary.blocked_kv_rotary',
            'v2.kernels.ragged_ops.linear_blocked_kv_rotary.blocked_trained_kv_rotary',
            'v2.kernels.ragged_ops.linear_blocked_kv_rotary.linear_blocked_kv_copy',
            'v2.kernels.ragged_ops.logits_gather', 'v2.kernels.ragged_ops.logits_gather.logits_gather',
            'v2.kernels.ragged_ops.moe_gather', 'v2.kernels.ragged_ops.moe_gather.moe_gather',
            'v2.kernels.ragged_ops.moe_scatter', 'v2.kernels.ragged_ops.moe_scatter.moe_scatter',
            'v2.kernels.ragged_ops.top_k_gating', 'v2.kernels.ragged_ops.top_k_gating.top_k_gating', 'v2.logging',
            'v2.model_implementations', 'v2.model_implementations.common_parameters',
            'v2.model_implementations.common_parameters.attn_output_parameters',
            'v2.model_implementations.common_parameters.embedding_parameters',
            'v2.model_implementations.common_parameters.invfreq_parameters',
            'v2.model_implementations.common_parameters.mlp_parameters',
            'v2.model_implementations.common_parameters.moe_parameters',
            'v2.model_implementations.common_parameters.norm_parameters',
            'v2.model_implementations.common_parameters.qkv_parameters',
            'v2.model_implementations.common_parameters.unembed_parameters', 'v2.model_implementations.exaone4',
            'v2.model_implementations.exaone4.container', 'v2.model_implementations.exaone4.model',
            'v2.model_implementations.exaone4.policy', 'v2.model_implementations.exaone4_5',
            'v2.model_implementations.exaone4_5.container', 'v2.model_implementations.exaone4_5.model',
            'v2.model_implementations.exaone4_5.policy', 'v2.model_implementations.falcon',
            'v2.model_implementations.falcon.container', 'v2.model_implementations.falcon.model',
            'v2.model_implementations.falcon.policy', 'v2.model_implementations.flat_model_helpers',
            'v2.model_implementations.inference_model_base', 'v2.model_implementations.inference_policy_base',
            'v2.model_implementations.inference_transformer_base', 'v2.model_implementations.layer_container_base',
            'v2.model_implementations.llama_v2', 'v2.model_implementations.llama_v2.container',
            'v2.model_implementations.llama_v2.model', 'v2.model_implementations.llama_v2.policy',
            'v2.model_implementations.mistral', 'v2.model_implementations.mistral.container',
            'v2.model_implementations.mistral.model', 'v2.model_implementations.mistral.policy',
            'v2.model_implementations.mixtral', 'v2.model_implementations.mixtral.container',
            'v2.model_implementations.mixtral.model', 'v2.model_implementations.mixtral.policy',
            'v2.model_implementations.opt', 'v2.model_implementations.opt.container',
            'v2.model_implementations.opt.model', 'v2.model_implementations.opt.policy',
            'v2.model_implementations.parameter_base', 'v2.model_implementations.phi',
            'v2.model_implementations.phi.containers', 'v2.model_implementations.phi.model',
            'v2.model_implementations.phi.policy', 'v2.model_implementations.phi3',
            'v2.model_implementations.phi3.containers', 'v2.model_implementations.phi3.model',
            'v2.model_implementations.phi3.policy', 'v2.model_implementations.qwen',
            'v2.model_implementations.qwen.container', 'v2.model_implementations.qwen.model',
            'v2.model_implementations.qwen.policy', 'v2.model_implementations.qwen_v2',
            'v2.model_implementations.qwen_v2.container', 'v2.model_implementations.qwen_v2.model',
            'v2.model_implementations.qwen_v2.policy', 'v2.model_implementations.qwen_v2_moe',
            'v2.model_implementations.qwen_v2_moe.container', 'v2.model_implementations.qwen_v2_moe.model',
            'v2.model_implementations.qwen_v2_moe.policy', 'v2.model_implementations.sharding',
            'v2.model_implementations.sharding.attn', 'v2.model_implementations.sharding.attn_out',
            'v2.model_implementations.sharding.embedding', 'v2.model_implementations.sharding.mlp',
            'v2.model_implementations.sharding.qkv', 'v2.model_implementations.sharding.types',
            'v2.model_implementations.sharding.unembed', 'v2.model_implementations.sharding.utils', 'v2.modules',
            'v2.modules.configs', 'v2.modules.configs.attention_configs', 'v2.modules.configs.embedding_config',
            'v2.modules.configs.linear_config', 'v2.modules.configs.moe_config', 'v2.modules.configs.norm_config',
            'v2.modules.configs.unembed_config', 'v2.modules.ds_module', 'v2.modules.heuristics',
            'v2.modules.implementations', 'v2.modules.implementations.attention',
            'v2.modules.implementations.attention.dense_blocked_attention', 'v2.modules.implementations.embedding',
            'v2.modules.implementations.embedding.ragged_embedding', 'v2.modules.implementations.linear',
            'v2.modules.implementations.linear.blas_fp_linear',
            'v2.modules.implementations.linear.quantized_linear', 'v2.modules.implementations.moe',
            'v2.modules.implementations.moe.cutlass_multi_gemm', 'v2.modules.implementations.post_norm',
            'v2.modules.implementations.post_norm.cuda_post_ln', 'v2.modules.implementations.pre_norm',
            'v2.modules.implementations.pre_norm.cuda_pre_ln', 'v2.modules.implementations.pre_norm.cuda_pre_rms',
            'v2.modules.implementations.unembed', 'v2.modules.implementations.unembed.ragged_unembed',
            'v2.modules.interfaces', 'v2.modules.interfaces.attention_base', 'v2.modules.interfaces.embedding_base',
            'v2.modules.interfaces.linear_base', 'v2.modules.interfaces.moe_base',
            'v2.modules.interfaces.post_norm_base', 'v2.modules.interfaces.pre_norm_base',
            'v2.modules.interfaces.unembed_base', 'v2.modules.module_registry', 'v2.ragged',
            'v2.ragged.blocked_allocator', 'v2.ragged.kv_cache', 'v2.ragged.manager_configs',
            'v2.ragged.ragged_manager', 'v2.ragged.ragged_wrapper', 'v2.ragged.sequence_descriptor',
            'v2.scheduling_utils'
        ),
    ),
    'deepspeed.io': (
        "DeepSpeed's FastFileWriter/io library is not provided: dscore's NVMe transfers are the async_io op (deepspeed.ops.op_builder.AsyncIOBuilder) behind ZeRO-Infinity offload",
        (
            'base_file_writer', 'base_io_buffer', 'constants', 'double_io_buffer', 'fast_file_writer',
            'mock_file_writer', 'py_file_writer', 'single_io_buffer', 'utils'
        ),
    ),
    'deepspeed.launcher.multinode_runner': (
        "DeepSpeed's multi-node runner classes (pdsh, OpenMPI, MVAPICH, Slurm ...) are not provided: dscore's launcher is `dscore run` (deepspeed.launcher.runner)",
        (),
    ),
    'deepspeed.linear': (
        "DeepSpeed's OptimizedLinear (LoRA with sharded base weights, FP quantized linear) is not provided: use peft's LoRA layers with a dscore engine",
        ('config', 'context_manager', 'optimized_linear', 'quantization'),
    ),
    'deepspeed.model_implementations': (
        _INFERENCE,
        (
            'diffusers', 'diffusers.unet', 'diffusers.vae', 'features', 'features.cuda_graph', 'transformers',
            'transformers.clip_encoder', 'transformers.ds_base', 'transformers.ds_bert', 'transformers.ds_bloom',
            'transformers.ds_gpt', 'transformers.ds_llama2', 'transformers.ds_megatron_gpt', 'transformers.ds_opt',
            'transformers.ds_transformer'
        ),
    ),
    'deepspeed.monitor': (
        "DeepSpeed's monitor classes are not provided: dscore's monitors are the `tensorboard`, `wandb`, `csv_monitor` and `comet` config blocks (the monitor plugin), written by the engine",
        ('comet', 'config', 'csv_monitor', 'monitor', 'tensorboard', 'utils', 'wandb'),
    ),
    'deepspeed.ops.deepspeed4science': (
        "DeepSpeed4Science's Evoformer attention kernel is not provided",
        ('evoformer_attn',),
    ),
    'deepspeed.ops.op_builder.evoformer_attn': (
        "DeepSpeed4Science's Evoformer attention kernel is not provided",
        (),
    ),
    'deepspeed.ops.transformer': (
        "DeepSpeed's fused transformer kernels (training and inference CUDA/Triton ops) are not provided: keep the model's own torch layers (engine.compile() fuses them through torch.compile)",
        (
            'inference', 'inference.bias_add', 'inference.config', 'inference.diffusers_2d_transformer',
            'inference.diffusers_attention', 'inference.diffusers_transformer_block', 'inference.ds_attention',
            'inference.ds_mlp', 'inference.moe_inference', 'inference.op_binding', 'inference.op_binding.base',
            'inference.op_binding.bias_add', 'inference.op_binding.bias_gelu', 'inference.op_binding.bias_relu',
            'inference.op_binding.bias_residual', 'inference.op_binding.einsum_sec_sm_ecm',
            'inference.op_binding.gated_activation', 'inference.op_binding.gelu_gemm',
            'inference.op_binding.layer_norm', 'inference.op_binding.linear', 'inference.op_binding.mlp_gemm',
            'inference.op_binding.moe_res_matmul', 'inference.op_binding.pad_transform',
            'inference.op_binding.pre_rms_norm', 'inference.op_binding.qkv_gemm',
            'inference.op_binding.residual_add', 'inference.op_binding.rms_norm', 'inference.op_binding.softmax',
            'inference.op_binding.softmax_context', 'inference.op_binding.vector_add',
            'inference.op_binding.vector_matmul', 'inference.op_binding.workspace', 'inference.triton',
            'inference.triton.attention', 'inference.triton.gelu', 'inference.triton.layer_norm',
            'inference.triton.matmul_ext', 'inference.triton.mlp', 'inference.triton.ops',
            'inference.triton.residual_add', 'inference.triton.softmax', 'inference.triton.triton_matmul_kernel',
            'inference.triton_ops', 'transformer'
        ),
    ),
    'deepspeed.ops.triton_ops': (
        "DeepSpeed's Triton kernels are not provided: keep the model's own torch layers (engine.compile() fuses them through torch.compile)",
        (
            '_triton', 'autoep_fused_token_ops', 'fused_rms_norm', 'fused_rotary_pos_emb', 'group_gemm_triton',
            'swiglu_triton'
        ),
    ),
    'deepspeed.runtime.swap_tensor.aio_config': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.async_swapper': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.constants': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.optimizer_utils': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.partitioned_param_swapper': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper': (_SWAP, ()),
    'deepspeed.runtime.swap_tensor.utils': (_SWAP, ()),
    'deepspeed.runtime.bf16_optimizer': (
        "DeepSpeed's BF16_Optimizer wrapper is not provided: dscore's bf16 mixed precision is the engine's `bf16` config block (the precision plugin, fp32 master weights in the ZeRO stage)",
        (),
    ),
    'deepspeed.runtime.checkpoint_engine': (
        "DeepSpeed's checkpoint-engine classes are not provided: dscore writes checkpoints through engine.save_checkpoint/load_checkpoint (dscore.persistence, the `checkpoint` config block)",
        (
            'checkpoint_engine', 'datastates_checkpoint_engine', 'decoupled_checkpoint_engine',
            'fast_checkpoint_engine', 'torch_checkpoint_engine', 'utils'
        ),
    ),
    'deepspeed.runtime.comm': (
        "DeepSpeed's compressed (1-bit, quantized) communication backends are not provided: dscore's collectives are dscore.comm (deepspeed.comm)",
        ('coalesced_collectives',),
    ),
    'deepspeed.runtime.fp16': (
        "DeepSpeed's FP16_Optimizer/FP16_UnfusedOptimizer wrappers, loss scalers and 1-bit optimizers are not provided: dscore's fp16 mixed precision and loss scaling are the engine's `fp16` config block (the precision plugin)",
        ('fused_optimizer', 'loss_scaler', 'unfused_optimizer'),
    ),
    'deepspeed.runtime.hybrid_engine_graph': (
        "DeepSpeed's hybrid-engine CUDA graph capture is not provided: dscore's hybrid engine (the `hybrid_engine` block) refuses enable_cuda_graph",
        (),
    ),
    'deepspeed.runtime.sparse_tensor': (
        "DeepSpeed's SparseTensor (sparse gradient all-reduce) is not provided: dscore reduces dense gradients",
        (),
    ),
    'deepspeed.runtime.tensor_parallel': (
        "DeepSpeed's tensor_parallel config objects are not provided: dscore's AutoTP is the `tensor_parallel` config block (dscore.parallel, deepspeed.tp_model_init)",
        ('config', 'init_utils', 'tp_manager'),
    ),
    'deepspeed.runtime.torch_autocast': (
        "DeepSpeed's torch_autocast internals (per-parameter communication dtypes) are not provided: dscore's autocast is the `torch_autocast` config block of the precision plugin",
        (),
    ),
    'deepspeed.runtime.zenflow': (
        "ZenFlow (DeepSpeed's stall-free offloading optimizer) is not provided: dscore offloads optimizer state with zero_optimization.offload_optimizer",
        ('engine', 'engine_stage3', 'zenflow_config', 'zenflow_stage_1_and_2', 'zenflow_utils'),
    ),
}


def _index() -> dict[str, tuple[str, bool]]:
    """Every refused module name -> (reason, is a package)."""
    names: dict[str, tuple[str, bool]] = {}
    for root, (reason, subs) in REFUSED_TREES.items():
        full = [root, *(f"{root}.{s}" for s in subs)]
        parents = {n.rpartition(".")[0] for n in full}
        for n in full:
            names[n] = (reason, n in parents or (n == root and bool(subs)))
    return names


_NAMES = _index()


def refused_reason(module_name: str) -> str | None:
    """The reason ``module_name`` (a dotted ``deepspeed.`` name) is refused, or ``None`` when it is not one of
    :data:`REFUSED_TREES`' modules."""
    entry = _NAMES.get(module_name)
    return entry[0] if entry else None


class RefusedTreeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the modules of :data:`REFUSED_TREES` (and only those)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        entry = _NAMES.get(fullname)
        if entry is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=entry[1])

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        reason, _ = _NAMES[module.__name__]
        module.__doc__ = (f"``{module.__name__}`` (DeepSpeed 0.19.8): not provided by dscore; every name imports "
                          f"and raises NotProvidedError when used: {reason}")
        # imported here, not at module level: `import deepspeed` stays free of dscore and torch imports
        from deepspeed._not_provided import refused_module_getattr

        module.__getattr__ = refused_module_getattr(module.__name__, reason)  # type: ignore[method-assign]


def install() -> Any:
    """Append the finder to ``sys.meta_path`` once (after the path finders: real modules win); returns it."""
    for finder in sys.meta_path:
        if isinstance(finder, RefusedTreeFinder):
            return finder
    finder = RefusedTreeFinder()
    sys.meta_path.append(finder)
    return finder
