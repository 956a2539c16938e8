"""``grpo.py --trl``: TRL's ``GRPOTrainer`` on the same tiny Llama and reward, through the compat ``deepspeed``
distribution (Accelerate's DeepSpeed plugin at ZeRO-3, as ``TrainingArguments(deepspeed=...)`` sets it up).

The policy is built from the same ``LlamaConfig`` (no download) with ``from_config`` after the trainer's
arguments turned ZeRO-3 on, so inside ``deepspeed.zero.Init``; a word-level tokenizer covers its 16 tokens
(``<pad>``, ``<s>`` — also the end of sequence —, ``t2`` .. ``t15``). Trainer output goes to a temporary folder.
The reward is the fraction of completion tokens equal to ``--target`` (from TRL's ``completion_ids``).
The trainer's AdamW takes the ds_config's ``lr``/``betas``/``weight_decay`` and ``gradient_clipping``.

Why ``--beta 0`` (no reference model) only: TRL builds its reference with ``from_pretrained(model id)``. That
load under ZeRO-3 used to fail on dscore's released-parameter guard and now works
(tests/compat/test_from_pretrained_zero3.py), but this path with a reference is not yet tested, so it stays
refused; the dscore loop of ``grpo.py`` has its reference.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Any

import torch

VOCAB, PAD, BOS = 16, 0, 1


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no end-of-sequence token of its own: "<s>" doubles as eos (a completion may stop early on it)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<s>",
                                   unk_token="<pad>")


def _ds_config(config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face Trainer's form of the example's ds_config: ZeRO-3, batch sizes and clipping ``auto``
    (the trainer fills them from its arguments); the optimizer is the trainer's own AdamW."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": dict(config.get("zero_optimization", {"stage": 3})),
    }


def run_trl(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """Train ``args.steps`` GRPO steps with TRL; rank 0 prints each step's reward and KL and a summary."""
    from datasets import Dataset
    from grpo import tiny_llama_config
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    rank = int(os.environ.get("RANK", "0"))
    with tempfile.TemporaryDirectory(prefix="grpo-trl-") as tmp:
        g = torch.Generator().manual_seed(args.seed)
        prompts = [" ".join(["<s>"] + [f"t{int(t)}" for t in torch.randint(2, VOCAB, (args.prompt_len - 1,), generator=g)])
                   for _ in range(args.steps * args.prompts * 2)]
        target = args.target

        def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any) -> list[float]:
            return [sum(t == target for t in ids) / max(1, len(ids)) for ids in completion_ids]

        opt = dict(config.get("optimizer", {}).get("params", {}))  # the trainer's AdamW gets the ds_config's values
        cfg = GRPOConfig(
            output_dir=f"{tmp}/out", max_steps=args.steps, per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group, max_completion_length=args.new_tokens, temperature=args.temperature,
            top_k=0, top_p=1.0, learning_rate=float(opt.get("lr", 1e-3)),
            adam_beta1=float(opt.get("betas", [0.9, 0.999])[0]), adam_beta2=float(opt.get("betas", [0.9, 0.999])[1]),
            weight_decay=float(opt.get("weight_decay", 0.0)), lr_scheduler_type="constant",
            max_grad_norm=float(config.get("gradient_clipping", 0.0)), beta=args.beta, epsilon=args.clip, num_iterations=args.ppo_epochs,
            logging_steps=args.log_interval, report_to=[], save_strategy="no", seed=args.seed, bf16=False, fp16=False,
            deepspeed=_ds_config(config), disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        )
        # built after GRPOConfig (which turns on ZeRO-3 for transformers): from_config runs inside
        # deepspeed.zero.Init, the policy born partitioned, as the Trainer's own from_pretrained would be
        torch.manual_seed(args.seed)
        policy = AutoModelForCausalLM.from_config(tiny_llama_config())
        trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=cfg, processing_class=_tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
        trainer.train()
        import deepspeed

        engine = trainer.model_wrapped  # the engine Accelerate's DeepSpeed plugin built through `deepspeed`
        if rank == 0:
            print(f"TRL GRPOTrainer: engine {type(engine).__module__}.{type(engine).__name__} from `deepspeed` "
                  f"(dscore's layer: {getattr(deepspeed, '__dscore__', False)}), ZeRO stage "
                  f"{engine.zero_optimization_stage()}", flush=True)
        rows = [h for h in trainer.state.log_history if "reward" in h]
        if rank == 0:
            for h in rows:
                print(f"step {int(h['step']):4d}/{args.steps} | reward {h['reward']:.3f} | kl {h.get('kl', 0.0):.4f} | "
                      f"loss {h.get('loss', 0.0):+.4f}", flush=True)
            k = max(1, math.ceil(len(rows) / 10))
            first = sum(h["reward"] for h in rows[:k]) / k
            last = sum(h["reward"] for h in rows[-k:]) / k
            print(f"summary (TRL): {args.steps} steps, {len(rows)} with a reward logged; mean reward first {k} steps {first:.3f}, last {k} steps "
                  f"{last:.3f}", flush=True)
    return 0
