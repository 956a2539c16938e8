"""GRPO on a tiny Llama with dscore's hybrid engine — a small RLHF loop.

    dscore run --num_gpus 2 examples/rlhf/grpo.py --deepspeed_config examples/rlhf/ds_config.json
    python examples/rlhf/grpo.py            # one process; the ds_config next to this file by default
    dscore run --num_gpus 2 examples/rlhf/grpo.py --trl --steps 4   # TRL's GRPOTrainer, same model and reward

The policy is a tiny ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download) under the engine that
``dscore.initialize`` builds from the ds_config (the hybrid engine at ZeRO-3: ``engine.generate`` gathers the
partitioned parameters once per call). The reference is a frozen copy of the initial policy in a second,
inference-only ZeRO-3 engine (no optimizer; how DeepSpeed-Chat and OpenRLHF hold theirs). Each step:

1. every rank draws ``--prompts`` random prompts and samples ``--group`` completions of ``--new_tokens``
   tokens for each with ``engine.generate(do_sample=True)``;
2. reward = the fraction of completion tokens equal to ``--target`` (a rule a tiny model learns quickly);
3. advantage = (reward - group mean) / (group std + 1e-4), per prompt (GRPO's group-relative baseline);
4. ``--ppo_epochs`` passes of the clipped policy-gradient loss
   ``-min(r A, clip(r, 1-eps, 1+eps) A) + beta * KL`` per completion token, where ``r`` is the ratio of the
   current to the sampling policy's token probability and KL is the k3 estimator
   ``exp(ref - logp) - (ref - logp) - 1`` against the reference; averaged over each completion's tokens,
   then over completions.

Rank 0 prints one line per ``--log_interval`` steps (mean reward over all ranks, KL, loss) and a summary: the
mean reward of the first and the last tenth of the steps.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

import dscore
from dscore.config.loader import read_source

HERE = Path(__file__).resolve().parent
VOCAB, BOS, PAD = 16, 1, 0  # token 0 pads, 1 begins; prompts and completions use 2..15


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser whose help and error text only rank 0 prints (``dscore run`` starts one process per rank)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if _is_rank_zero():
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        super().exit(status if _is_rank_zero() else 0, message)


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0").strip() in ("", "0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = RankZeroParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="GRPO steps (each: generate, score, --ppo_epochs updates)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rank and step")
    p.add_argument("--group", type=int, default=4, help="completions sampled per prompt (GRPO's group size)")
    p.add_argument("--prompt_len", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=8, help="tokens generated per completion")
    p.add_argument("--target", type=int, default=7, help="the token id the reward counts (2..15)")
    p.add_argument("--ppo_epochs", type=int, default=2, help="updates per batch of completions")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon")
    p.add_argument("--beta", type=float, default=None,
                   help="weight of the k3 KL penalty to the reference (default 0.04; with --trl only 0, the default there)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--log_interval", type=int, default=10, help="print a line every N steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trl", action="store_true",
                   help="run TRL's GRPOTrainer (through the compat `deepspeed` distribution) instead of this loop")
    p = dscore.add_config_arguments(p)  # --deepspeed_config and the --local_rank that `dscore run` passes
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "prompt_len", "new_tokens", "ppo_epochs", "log_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.group < 2:
        p.error(f"--group must be at least 2 (advantages are relative to the group), got {args.group}")
    if not 2 <= args.target < VOCAB:
        p.error(f"--target must be a token id in 2..{VOCAB - 1}, got {args.target}")
    if args.trl and args.beta not in (None, 0.0):
        # TRL loads its reference with from_pretrained, which under ZeRO-3 fails on dscore (trl_grpo.py says why)
        p.error(f"--trl runs without a reference model (--beta 0); got --beta {args.beta}")
    if args.beta is None:
        args.beta = 0.0 if args.trl else 0.04
    if args.deepspeed_config is None and args.deepscale_config is None:
        args.deepspeed_config = str(HERE / "ds_config.json")
    return args


def tiny_llama_config() -> Any:
    """The policy's ``LlamaConfig``: 2 layers, hidden size 32, a 16-token vocabulary, no end-of-sequence token."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None, tie_word_embeddings=False)


def tiny_llama(seed: int) -> Any:
    """A ``LlamaForCausalLM`` of :func:`tiny_llama_config` (~20k parameters), the same weights for the same seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    model.generation_config.eos_token_id = None  # completions always have --new_tokens tokens
    model.generation_config.pad_token_id = PAD
    return model


def reward_fn(completions: torch.Tensor, target: int) -> torch.Tensor:
    """``[n, new_tokens]`` int64 token ids -> ``[n]`` float32: the fraction equal to ``target``."""
    return (completions == target).float().mean(dim=1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """``[prompts * group]`` rewards (a prompt's completions adjacent) -> advantages of the same shape:
    reward minus its group's mean, over the group's std (unbiased) plus 1e-4."""
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def token_logprobs(model: Any, seqs: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
    """Log-probabilities ``[n, new]`` (float32) of the completion tokens of ``seqs`` ``[n, prompt + new]``
    under ``model`` (an engine or a module) at ``temperature``."""
    logits = model(input_ids=seqs).logits[:, prompt_len - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, adv: torch.Tensor,
              clip: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped policy-gradient loss plus ``beta`` times the k3 KL to the reference.

    Args: per-token log-probabilities ``[n, new]`` (current with grad, sampling policy, reference) and the
    advantages ``[n]``. Returns (loss, scalar; mean k3 KL, detached scalar): per token, averaged over each
    completion, then over completions.
    """
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    pg = -torch.min(ratio * a, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * a)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1.0
    loss = (pg + beta * kl).mean(dim=1).mean()
    return loss, kl.mean().detach()


def _all_mean(x: torch.Tensor) -> float:
    """The mean of the scalar ``x`` over the ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.detach().clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return float(x)


def say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def run_dscore(args: argparse.Namespace, config: dict[str, Any]) -> int:
    policy = tiny_llama(args.seed)
    reference = tiny_llama(args.seed)  # the same initial weights, frozen
    reference.requires_grad_(False)
    n = args.prompts * args.group
    config = dict(config)
    config["train_micro_batch_size_per_gpu"] = n  # one optimizer step per pass over this rank's completions
    engine, _, _, _ = dscore.initialize(args=args, model=policy, model_parameters=policy.parameters(), config=config)
    # the reference: an inference-only engine (no optimizer), ZeRO-3 as the policy
    ref_config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler", "hybrid_engine")}
    ref_engine, _, _, _ = dscore.initialize(model=reference, config=ref_config)
    ref_engine.eval()
    device = engine.device
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    params = sum(p.numel() for p in tiny_llama(args.seed).parameters())
    say(f"policy: tiny Llama, {params:,} parameters, ZeRO stage {engine.zero_optimization_stage()}; world size "
        f"{world}; {args.prompts} prompts x {args.group} completions of {args.new_tokens} tokens per rank and step; "
        f"reward: fraction of tokens == {args.target}")
    gen = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + rank)  # prompts differ by rank
    history: list[float] = []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        prompts = torch.randint(2, VOCAB, (args.prompts, args.prompt_len), generator=gen)
        prompts[:, 0] = BOS
        ids = prompts.repeat_interleave(args.group, dim=0).to(device)
        engine.eval()
        with torch.no_grad():
            seqs = engine.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                   temperature=args.temperature, top_k=0, top_p=1.0,
                                   max_new_tokens=args.new_tokens, pad_token_id=PAD)
            completions = seqs[:, args.prompt_len:]
            rewards = reward_fn(completions, args.target)
            adv = group_advantages(rewards, args.group)
            old_logp = token_logprobs(engine, seqs, args.prompt_len, args.temperature)
            ref_logp = token_logprobs(ref_engine, seqs, args.prompt_len, args.temperature)
        engine.train()
        for _ in range(args.ppo_epochs):
            logp = token_logprobs(engine, seqs, args.prompt_len, args.temperature)
            loss, kl = grpo_loss(logp, old_logp, ref_logp, adv, args.clip, args.beta)
            engine.backward(loss)
            engine.step()
        mean_reward = _all_mean(rewards.mean())
        history.append(mean_reward)
        if step % args.log_interval == 0 or step == args.steps:
            say(f"step {step:4d}/{args.steps} | reward {mean_reward:.3f} | kl {_all_mean(kl):.4f} | "
                f"loss {_all_mean(loss.detach()):+.4f} | {time.time() - t0:.1f} s")
    tenth = max(1, math.ceil(len(history) / 10))
    first, last = sum(history[:tenth]) / tenth, sum(history[-tenth:]) / tenth
    say(f"summary: {args.steps} steps in {time.time() - t0:.1f} s; mean reward first {tenth} steps {first:.3f}, "
        f"last {tenth} steps {last:.3f} (chance {1 / (VOCAB - 2):.3f})")
    ref_engine.close()
    engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config, _, _ = read_source(args)
    args.deepspeed_config = args.deepscale_config = None
    if args.trl:
        from trl_grpo import run_trl  # the TRL path lives next to this file

        return run_trl(args, config)
    return run_dscore(args, config)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
