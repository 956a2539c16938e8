"""Training jobs driven by the unchanged Hugging Face Trainer / Accelerate through ``import deepspeed``.

Each function runs on one rank of a 2-process gloo job (``dscore.testing.run_distributed(...,
init_process_group=False)``: Accelerate creates the process group itself) and returns plain data. The same
functions run against DeepSpeed 0.19.8 in ``bench/compat_vs_deepspeed.py``, which is how the per-step losses
are compared; so they use only what both provide.

The model is a tiny GPT-2 built from a config (no download), fed token-id tensors (no tokenizer); dropout is
off so runs are deterministic; fp32 throughout.
"""

from __future__ import annotations

import os
from typing import Any

VOCAB, SEQ, SAMPLES = 96, 16, 64


def ds_config(stage: int, gas: int = 2, config_optimizer: bool = False) -> dict[str, Any]:
    """The ds_config handed to ``TrainingArguments(deepspeed=...)`` ("auto" values filled by the Trainer).
    With ``config_optimizer`` the optimizer and LR schedule come from the config (AdamW, WarmupDecayLR), so
    the Trainer hands DeepSpeed Accelerate's placeholders instead of its own optimizer and scheduler."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    extra: dict[str, Any] = {}
    if config_optimizer:
        extra = {
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        }
    return {
        **extra,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }


def tiny_gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def tiny_llama_config() -> Any:
    """A tiny Llama (rotary embeddings: ``rotary_emb.inv_freq`` is a non-persistent buffer, as in every
    Llama/Mistral/Qwen/Mixtral)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.0, attn_implementation="sdpa",
    )


def _model_class(model: str) -> tuple[Any, Any]:
    """``(class, config)`` for ``model`` ("gpt2" or "llama")."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    if model == "llama":
        return LlamaForCausalLM, tiny_llama_config()
    return GPT2LMHeadModel, tiny_gpt2_config()


class TokenDataset:
    """``SAMPLES`` fixed random sequences of token ids; labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator(device="cpu").manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g, device="cpu")

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def _params_digest(model: Any) -> list[float]:
    import torch

    with torch.no_grad():
        return [float(p.double().sum()) for p in model.parameters()]


def trainer_run(
    stage: int,
    out_dir: str,
    max_steps: int = 10,
    save_steps: int = 5,
    resume: str | None = None,
    build_in_zero_init: bool = False,
    config_optimizer: bool = False,
    model_kind: str = "gpt2",
    torch_compile_backend: str | None = None,
) -> dict[str, Any]:
    """Train ``model_kind`` ("gpt2" or "llama", tiny, from a config) with ``transformers.Trainer(args=TrainingArguments(deepspeed=cfg, use_cpu=True))``.

    Returns ``{"losses": {step: loss}, "grad_norms": {step: norm}, "checkpoints": [...], "deepspeed":
    deepspeed.__version__, "engine": type name}``. With ``resume`` the Trainer resumes from that checkpoint
    folder. ``build_in_zero_init`` builds the model after ``TrainingArguments`` through ``from_config`` (at
    ZeRO-3 the model is then born partitioned inside ``deepspeed.zero.Init``); otherwise it is built first,
    seeded, as a plain module. ``torch_compile_backend`` turns on ``TrainingArguments(torch_compile=True)``
    with that backend (Accelerate then calls ``engine.compile(backend=..., compile_kwargs=...)``); the result
    then also holds ``is_compiled``, ``unique_graphs`` and ``graph_breaks`` (dynamo's counters).
    """
    import deepspeed
    import torch
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(42)
    model_cls, model_cfg = _model_class(model_kind)
    model = None if build_in_zero_init else model_cls(model_cfg)
    args = TrainingArguments(
        output_dir=out_dir,
        deepspeed=ds_config(stage, config_optimizer=config_optimizer),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_steps=max_steps,
        logging_steps=1,
        save_steps=save_steps,
        save_strategy="steps",
        report_to=[],
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_only_model=False,
        **({"torch_compile": True, "torch_compile_backend": torch_compile_backend} if torch_compile_backend else {}),
    )
    if model is None:
        model = model_cls._from_config(model_cfg)
    born_partitioned = all(hasattr(p, "ds_numel") for p in model.parameters())  # zero.Init partitioned it
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    losses = {int(h["step"]): float(h["loss"]) for h in history if "loss" in h}
    norms = {int(h["step"]): float(h["grad_norm"]) for h in history if "grad_norm" in h}
    checkpoints = sorted(d for d in os.listdir(out_dir) if d.startswith("checkpoint-"))
    engine = trainer.model_wrapped
    result = {
        "losses": losses,
        "grad_norms": norms,
        "checkpoints": checkpoints,
        "deepspeed": deepspeed.__version__,
        "engine": type(engine).__name__,
        "is_engine": isinstance(engine, deepspeed.DeepSpeedEngine),
        "born_partitioned": born_partitioned,
        "torch_threads": torch.get_num_threads(),
    }
    if torch_compile_backend:
        from torch._dynamo.utils import counters

        result["is_compiled"] = bool(engine.is_compiled)
        result["unique_graphs"] = int(counters["stats"]["unique_graphs"])
        result["graph_breaks"] = sum(counters["graph_break"].values())
    return result


def trainer_compile_job(stage: int, out_dir: str, backend: str = "aot_eager", steps: int = 4) -> dict[str, Any]:
    """The Trainer on a tiny Llama, eager then ``torch_compile=True`` (``backend``), same seed and data."""
    eager = trainer_run(stage, os.path.join(out_dir, "eager"), max_steps=steps, save_steps=100, model_kind="llama")
    compiled = trainer_run(
        stage, os.path.join(out_dir, "compiled"), max_steps=steps, save_steps=100, model_kind="llama",
        torch_compile_backend=backend,
    )
    return {"eager": eager, "compiled": compiled}


def accelerate_run(stage: int, steps: int = 6) -> dict[str, Any]:
    """Accelerate's own loop: ``PartialState(cpu=True)``, ``Accelerator(deepspeed_plugin=...)``, prepare,
    ``accelerator.backward`` / ``optimizer.step`` / ``zero_grad``; returns the per-step losses (rank-local)."""
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, set_seed
    from torch.utils.data import DataLoader
    from transformers import GPT2LMHeadModel

    PartialState(cpu=True)
    set_seed(7)
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    })
    accelerator = Accelerator(deepspeed_plugin=plugin)  # the process state is already the CPU one
    model = GPT2LMHeadModel(tiny_gpt2_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TokenDataset(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    for i, batch in enumerate(loader):
        if i == steps:
            break
        out = model(**batch)
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    state = accelerator.get_state_dict(model)  # ZeRO-3: gathered on rank 0 (engine._zero3_consolidated_...)
    names = sorted(state) if state is not None else []
    digest = float(sum(v.double().sum() for v in state.values())) if state else None
    accelerator.end_training()
    return {"losses": losses, "state_keys": len(names), "state_digest": digest, "engine": type(model).__name__}


def trainer_resume_job(
    stage: int, root: str, build_in_zero_init: bool = False, config_optimizer: bool = False,
    model_kind: str = "gpt2", max_steps: int = 10, save_steps: int = 5,
) -> dict[str, Any]:
    """Train ``max_steps`` steps saving every ``save_steps``, then, in a fresh Trainer, model and engine in the
    same processes, resume from a copy of ``checkpoint-<save_steps>`` alone and train to ``max_steps``.
    Returns both runs' results."""
    import shutil

    from accelerate.state import AcceleratorState, PartialState

    full_dir, resume_dir = os.path.join(root, "full"), os.path.join(root, "resume")
    first = f"checkpoint-{save_steps}"
    full = trainer_run(stage, full_dir, max_steps=max_steps, save_steps=save_steps,
                       build_in_zero_init=build_in_zero_init, config_optimizer=config_optimizer, model_kind=model_kind)
    import torch.distributed as dist

    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        shutil.copytree(os.path.join(full_dir, first), os.path.join(resume_dir, first))
    dist.barrier()
    # a new Trainer builds a new Accelerator; the process-wide state keeps the process group
    AcceleratorState._reset_state(reset_partial_state=False)
    PartialState(cpu=True)
    resumed = trainer_run(
        stage, resume_dir, max_steps=max_steps, save_steps=save_steps, resume=os.path.join(resume_dir, first),
        build_in_zero_init=build_in_zero_init, config_optimizer=config_optimizer, model_kind=model_kind,
    )
    tag_dir = os.path.join(full_dir, first, f"global_step{save_steps}")
    files = sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []
    return {"full": full, "resumed": resumed, "files": files,
            "fp32_vs_saved_model": fp32_vs_saved_model(os.path.join(full_dir, first))}


def fp32_vs_saved_model(checkpoint: str) -> dict[str, Any]:
    """``deepspeed.utils.zero_to_fp32`` on a Trainer checkpoint folder against the weights the Trainer saved
    next to it (``model.safetensors``): the key sets and the largest absolute difference."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    fp32 = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    saved = load_file(os.path.join(checkpoint, "model.safetensors"))
    return {
        "missing": sorted(set(saved) - set(fp32)),
        "extra": sorted(set(fp32) - set(saved)),
        "max_abs_diff": max(float((fp32[k].float() - saved[k].float()).abs().max()) for k in saved if k in fp32),
    }


def accelerate_stages_job(stages: tuple[int, ...] = (2, 3), trl_dir: str | None = None) -> dict[Any, dict[str, Any]]:
    """:func:`accelerate_run` at each stage in turn, then (with ``trl_dir``) :func:`trl_sft_run` at ZeRO-3,
    in the same processes (one process group, started once)."""
    from accelerate.state import AcceleratorState, PartialState

    out: dict[Any, dict[str, Any]] = {}
    for stage in stages:
        out[stage] = accelerate_run(stage)
        AcceleratorState._reset_state(reset_partial_state=False)
    if trl_dir is not None:
        PartialState(cpu=True)
        out["trl"] = trl_sft_run(3, trl_dir)
    return out


def trl_sft_run(stage: int, out_dir: str, steps: int = 3) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` for a few steps on pre-tokenized sequences (a word-level tokenizer built in
    memory: no download). Returns the per-step losses and the engine type."""
    import deepspeed
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, set_seed
    from trl import SFTConfig, SFTTrainer

    set_seed(42)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), unk_token="t0", pad_token="t1", eos_token="t2"
    )
    model = GPT2LMHeadModel(tiny_gpt2_config())
    data = Dataset.from_dict({"input_ids": TokenDataset().ids.tolist()})
    args = SFTConfig(
        output_dir=out_dir, deepspeed=ds_config(stage), use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, learning_rate=1e-3, max_steps=steps, logging_steps=1, save_strategy="no",
        report_to=[], seed=42, disable_tqdm=True, max_length=SEQ,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    losses = {int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h}
    return {"losses": losses, "engine": type(trainer.model_wrapped).__name__,
            "is_engine": isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine)}
