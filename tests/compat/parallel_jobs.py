"""Issue 38 item 6: the unchanged Hugging Face Trainer with AutoTP, and with Accelerate's Ulysses
``ParallelismConfig``, on dscore through ``import deepspeed`` (one rank of a 2-process gloo job each;
Accelerate creates the process group). A tiny LlamaForCausalLM built from a config, fp32, no download."""

from __future__ import annotations

import os
from typing import Any

VOCAB, SEQ, SAMPLES = 64, 16, 16


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


class _Tokens:
    """``SAMPLES`` fixed random sequences; labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator(device="cpu").manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g, device="cpu")

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def _ds_config(stage: int, *, optimizer_block: bool = True, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        **extra,
    }
    if optimizer_block:
        # without it the Trainer builds its own torch AdamW (two groups: decay / no decay) over the unsplit model
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
    return cfg


def _train(out_dir: str, ds_config: dict[str, Any], **training_args: Any) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(42)
    model = _llama()
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config, use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, learning_rate=1e-3, max_steps=3, logging_steps=1, save_strategy="no",
        report_to=[], seed=42, dataloader_num_workers=0, disable_tqdm=True, **training_args,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    engine = trainer.model_wrapped
    loader = trainer.callback_handler.train_dataloader  # the Ulysses adapter, under a ParallelismConfig
    losses = {int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h}
    mesh = engine.runtime.mesh
    return {
        "losses": losses,
        "engine": type(engine).__name__,
        "batch": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                  engine.gradient_accumulation_steps()),
        "mesh": (mesh.dp_size, mesh.sp_size, mesh.tp_size),
        "adapter": getattr(loader, "mode", None),
        "adapter_len": len(loader),
    }


def trainer_autotp_job(root: str, stages: tuple[int, ...] = (1, 2)) -> dict[int, dict[str, Any]]:
    """The Trainer with ``tensor_parallel.autotp_size: 2`` at each ZeRO stage in turn (same processes)."""
    from accelerate.state import AcceleratorState, PartialState

    out: dict[int, dict[str, Any]] = {}
    for stage in stages:
        out[stage] = _train(os.path.join(root, f"tp{stage}"), _ds_config(stage, tensor_parallel={"autotp_size": 2}))
        AcceleratorState._reset_state(reset_partial_state=False)
        PartialState(cpu=True)
    return out


def trainer_own_optimizer_job(root: str, tp: int) -> dict[int, dict[str, Any]]:
    """Item 6, first gap: no ``optimizer`` block, so the Trainer builds its own torch AdamW (decay / no-decay
    groups, weight decay 5: large enough that losing it moves the losses past the tests' tolerance) over the
    unsplit model and passes it to ``initialize``; at ZeRO 1 and 2 with
    ``tensor_parallel.autotp_size: tp`` (``tp`` 1: the one-process reference, no tensor parallelism)."""
    from accelerate.state import AcceleratorState, PartialState

    out: dict[int, dict[str, Any]] = {}
    for stage in (1, 2):
        extra = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}
        cfg = _ds_config(stage, optimizer_block=False, **extra)
        out[stage] = _train(os.path.join(root, f"own{tp}-{stage}"), cfg, weight_decay=5.0)
        AcceleratorState._reset_state(reset_partial_state=False)
        PartialState(cpu=True)
    if tp > 1:
        out[0] = {"refused": _stepped_optimizer_refused(tp)}
    return out


def _stepped_optimizer_refused(tp: int) -> str:
    """A client optimizer that has already stepped holds unsplit-shaped state: refused, naming where."""
    import torch

    import dscore
    from dscore.errors import ConfigError

    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp},
           "zero_allow_untested_optimizer": True}
    try:
        dscore.initialize(model=model, optimizer=opt, config=cfg)
    except ConfigError as e:
        return str(e)
    return "accepted"


def initialize_with_ulysses_mpu_job() -> dict[str, Any]:
    """What Accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` hands ``deepspeed.initialize``:
    the mesh of ``UlyssesSPAttentionHF.register_with_transformers`` as ``mpu`` and a config without
    ``sequence_parallel_size``, its ``train_batch_size`` = micro x accumulation x data-parallel size (1)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = _llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, sequence_parallel_size=2, seq_length=SEQ, seq_length_is_variable=False,
        core_attn_implementation="sdpa", micro_batch_size=2)
    model.set_attn_implementation("ulysses")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config_params=config, mpu=mpu)
    out = {
        "batch": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                  engine.gradient_accumulation_steps()),
        "mesh_is_mpu": engine.runtime.mesh is mpu,
        "sequence_parallel_size": engine.config.sequence_parallel_size,
        "dp_world_size": engine.dp_world_size,
    }
    engine.close()
    return out


def groups_outside_engine_calls_job() -> dict[str, Any]:
    """Item 6, second gap: ``deepspeed.utils.groups`` called outside any engine call, as Accelerate's
    ``deepspeed_ulysses_dl_adapter`` and the Trainer's sequence-parallel loss do: before ``initialize`` (the
    mpu ``register_with_transformers`` built), after it (the live engine's mesh), with a second live engine of
    another mesh (refused, naming both), and once every engine is closed and the mpu dropped (refused)."""
    import gc

    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups

    from dscore.errors import DscoreError

    def read() -> tuple[Any, ...]:
        return (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank(),
                groups._get_data_parallel_world_size(), groups._get_data_parallel_rank(),
                groups.get_tensor_model_parallel_world_size(), groups._get_model_parallel_world_size(),
                groups._get_sequence_data_parallel_world_size())

    def refusal() -> str:
        try:
            read()
        except DscoreError as e:
            return str(e)
        return "accepted"

    out: dict[str, Any] = {}
    deepspeed.init_distributed()
    out["nothing"] = refusal()
    model = _llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, sequence_parallel_size=2, seq_length=SEQ, seq_length_is_variable=False,
        core_attn_implementation="sdpa", micro_batch_size=2)
    model.set_attn_implementation("ulysses")
    out["before"] = read()
    out["before_group"] = groups._get_sequence_parallel_group() is mpu.get_sequence_parallel_group()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config_params=config, mpu=mpu)
    del mpu
    gc.collect()
    out["after"] = read()
    group = groups._get_sequence_parallel_group()
    out["after_group"] = group is engine.runtime.mesh.get_sequence_parallel_group() and dist.get_world_size(group) == 2
    plain = _llama()  # a plain data-parallel engine (dp 2) beside the Ulysses one (sp 2)
    other, _, _, _ = deepspeed.initialize(model=plain, config_params={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out["two"] = refusal()
    other.close()
    out["one_closed"] = read()
    engine.close()
    gc.collect()
    out["all_closed"] = refusal()
    return out


def trainer_ulysses_job(root: str, sp: int) -> dict[str, Any]:
    """Item 6, last gap: the unchanged Trainer with Accelerate's ``ParallelismConfig(sp_backend="deepspeed",
    sp_size=sp)`` (Ulysses), ZeRO 1, through ``import deepspeed``; ``sp`` 1: the one-process reference (no
    parallelism config). Accelerate's loader gives each process its own batches; the Ulysses adapter
    all-gathers them over the sequence-parallel group and every rank trains its shard of each in rank order,
    so with one data-parallel rank the steps see the same samples, in the same order, as one process."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    extra: dict[str, Any] = {}
    if sp > 1:
        # sp_attn_implementation unset (None) is refused by DeepSpeed 0.19.8 as by dscore: name the model's
        handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
        extra["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler)
    return _train(os.path.join(root, f"sp{sp}"), _ds_config(1), **extra)
