"""Rank functions for tests/distributed/test_hybrid_engine.py and test_rollout_engine.py (importable by spawned ranks)."""

from __future__ import annotations

import copy
from typing import Any

VOCAB, PAD, EOS, MICRO = 64, 0, 5, 2
LR = 1e-2


def tiny_model(kind: str) -> Any:
    """A tiny causal LM built from a config (no download); same weights for the same ``kind``."""
    import torch

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1,
    )
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**common))


def config(zero: dict[str, Any], **hybrid: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "hybrid_engine": {"enabled": True, "max_out_tokens": 64, **hybrid},
    }


def prompts(rank: int) -> tuple[Any, Any]:
    """Left-padded prompts, different on each rank (so ranks may stop generating at different steps)."""
    import torch

    rows = [[PAD, PAD, 3, 4, 7, 9], [11, 12, 13, 14, 15, 16]] if rank == 0 else [[PAD, 8, 6, 21, 22, 23], [PAD, PAD, PAD, 30, 31, 2]]
    ids = torch.tensor(rows)
    return ids, (ids != PAD).long()


class GatherCounter:
    """Counts FlatUnit gathers that launch a collective (a unit not yet gathered)."""

    def __init__(self) -> None:
        from dscore.zero.partition import FlatUnit

        self.count = 0
        self._cls = FlatUnit
        self._orig = FlatUnit.gather

        def gather(unit: Any, *a: Any, **k: Any) -> Any:
            if not unit.gathered:
                self.count += 1
            return self._orig(unit, *a, **k)

        FlatUnit.gather = gather  # type: ignore[method-assign]

    def restore(self) -> None:
        self._cls.gather = self._orig  # type: ignore[method-assign]


def _train_both(engine: Any, ref: Any, opt: Any, steps: int) -> tuple[list[float], list[float]]:
    """The same batch on every rank, so the data-parallel mean gradient is the single-process one."""
    import torch

    g = torch.Generator().manual_seed(3)
    got, want = [], []
    engine.train()
    ref.train()
    for _ in range(steps):
        ids = torch.randint(6, VOCAB, (MICRO, 10), generator=g)
        loss = engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        got.append(float(loss.detach()))
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(ref_loss.detach()))
    return got, want


def hybrid_generate(cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (model kind, zero block, hybrid keys): greedy tokens of engine.generate vs the single-process model
    before and after training steps, gathers per generate call, the forward lengths (KV cache), losses."""
    import torch
    import torch.distributed as dist

    import dscore

    out = []
    for kind, zero, hybrid in cases:
        model = tiny_model(kind)
        ref = copy.deepcopy(model)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        engine, *_ = dscore.initialize(model=model, config=config(zero, **hybrid))
        rank = dist.get_rank()
        ids, mask = prompts(rank)
        stage = engine.zero_stage_impl
        units = [s for s in getattr(stage, "units", []) if not s.unit.persistent]
        lengths: list[int] = []
        handle = engine.module.register_forward_pre_hook(
            lambda m, a, k, seen=lengths: seen.append(int(k["input_ids"].shape[1])), with_kwargs=True
        )
        res: dict[str, Any] = {"kind": kind, "stage": zero["stage"], "units": len(units)}
        for phase in ("before", "after"):
            if phase == "after":
                res["losses"], res["ref_losses"] = _train_both(engine, ref, opt, 2)
            engine.eval()
            ref.eval()
            counter = GatherCounter()
            lengths.clear()
            try:
                got = engine.generate(ids.to(engine.device), attention_mask=mask.to(engine.device), max_new_tokens=8,
                                      do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
            finally:
                counter.restore()
            want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=EOS,
                                pad_token_id=PAD)
            res[phase] = (got.cpu().tolist(), want.tolist())
            res[f"gathers_{phase}"] = counter.count
            res[f"lengths_{phase}"] = list(lengths)
            res[f"released_{phase}"] = all(not s.unit.gathered for s in units)
        handle.remove()
        res["iters"] = engine._iters
        res["training_latency_positive"] = engine._training_latency >= 0.0
        out.append(res)
        engine.close()
    return out


def hybrid_checks() -> dict[str, Any]:
    """The refusals, release_inference_cache, generation_mode re-entry, sampling equal across ranks."""
    import torch
    import torch.distributed as dist

    import dscore
    from dscore.errors import ConfigError
    from dscore.pipe import PipelineModule

    res: dict[str, Any] = {}

    def refused(cfg: dict[str, Any], model: Any = None) -> str:
        try:
            e, *_ = dscore.initialize(model=tiny_model("llama") if model is None else model, config=cfg)
        except ConfigError as exc:
            return str(exc)
        e.close()
        return "accepted"

    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    res["tp3"] = refused(config(z3, inference_tp_size=3))
    res["tp2"] = refused(config(z3, inference_tp_size=2))
    res["cuda_graph"] = refused(config(z3, enable_cuda_graph=True))
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    pipe = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    res["pipeline"] = refused({**config({"stage": 0})}, pipe)

    engine, *_ = dscore.initialize(model=tiny_model("llama"), config=config(z3, release_inference_cache=True))
    engine.eval()
    ids, mask = prompts(0)
    try:
        engine.generate(ids, attention_mask=mask, max_new_tokens=60)
        res["max_out"] = "accepted"
    except ConfigError as exc:
        res["max_out"] = str(exc)
    o = engine.generate(ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, do_sample=False,
                        pad_token_id=PAD)
    res["released_cache"] = o.past_key_values is None
    # sampling: the same RNG on every rank after construction (DeepSpeed broadcasts rank 0's state)
    torch.manual_seed(1234 + dist.get_rank())
    engine._sync_rng()
    s = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=PAD)
    res["sampled"] = s.tolist()
    counter = GatherCounter()
    try:
        with engine.generation_mode():
            with engine.generation_mode():
                engine.module(input_ids=ids)
            engine.module(input_ids=ids)
    finally:
        counter.restore()
    res["reentrant_gathers"] = counter.count
    res["units"] = len([s for s in engine.zero_stage_impl.units if not s.unit.persistent])
    engine.close()

    engine, *_ = dscore.initialize(model=tiny_model("llama"), config=config(z3))
    engine.eval()
    o = engine.generate(ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, do_sample=False,
                        pad_token_id=PAD)
    res["kept_cache"] = o.past_key_values is not None
    engine.close()
    return res


def rollout_generate(zero: dict[str, Any]) -> dict[str, Any]:
    """HybridEngineRollout over a 2-rank engine (different prompts per rank) vs the single-process model's
    ``generate`` (greedy, n samples) before and after a training step; continuous batching; build_rollout."""
    import types

    import torch
    import torch.distributed as dist

    import dscore
    from dscore.rollout import RolloutConfig, RolloutRequest, SamplingConfig, build_rollout
    from dscore.rollout.hybrid_engine_rollout import pad_after_eos

    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    engine, *_ = dscore.initialize(model=model, config=config(zero))
    tok = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=36)
    rollout = build_rollout(RolloutConfig(), engine, tok)
    ids, mask = prompts(dist.get_rank())
    req = RolloutRequest(ids.to(engine.device), mask.to(engine.device))
    res: dict[str, Any] = {}
    for phase in ("before", "after"):
        if phase == "after":
            _train_both(engine, ref, opt, 1)
            rollout.sync_weights(engine.global_steps)
        engine.eval()
        ref.eval()
        got = rollout.generate(req, SamplingConfig(max_new_tokens=6, temperature=0.0, n_samples_per_prompt=2))
        raw = ref.generate(ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0), max_new_tokens=6,
                           do_sample=False, eos_token_id=None, pad_token_id=PAD)
        want, _ = pad_after_eos(raw, ids.shape[1], 36, PAD)
        cont = rollout.generate(req, SamplingConfig(max_new_tokens=6, temperature=0.0, continuous_batch_size=1))
        alone = [ref.generate(ids[i : i + 1], attention_mask=mask[i : i + 1], max_new_tokens=6, do_sample=False,
                              eos_token_id=36, pad_token_id=PAD)[0, ids.shape[1]:].tolist() for i in range(ids.shape[0])]
        res[phase] = {
            "got": got.input_ids.cpu().tolist(), "want": want.tolist(),
            "start": got.response_start_idx.tolist(),
            "cont": [r[ids.shape[1]:] for r in cont.input_ids.cpu().tolist()], "alone": alone,
            "cont_mask": cont.attention_mask[:, ids.shape[1]:].cpu().tolist(),
        }
    rollout.shutdown()
    engine.close()
    return res


def hybrid_cycles(cases: list[dict[str, Any]], cycles: int) -> list[dict[str, Any]]:
    """Per ZeRO-3 block: ``cycles`` x (greedy engine.generate vs a single-process model holding the engine's current
    full weights, then one training step of the engine and of a twin engine that never generates); per cycle
    whether the tokens matched, the gathers of the call, whether every unit was released after it, both losses;
    the rank's RSS (MiB) after the first and the last cycle."""
    import os

    import torch

    import dscore

    def rss() -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def step(e: Any, ids: Any) -> float:
        e.train()
        loss = e(input_ids=ids.to(e.device), labels=ids.to(e.device)).loss
        e.backward(loss)
        e.step()
        return float(loss.detach())

    out = []
    for zero in cases:
        model = tiny_model("llama")
        probe = copy.deepcopy(model).eval()
        engine, *_ = dscore.initialize(model=model, config=config(zero))
        twin, *_ = dscore.initialize(model=tiny_model("llama"), config=config(zero))
        units = [s for s in engine.zero_stage_impl.units if not s.unit.persistent]
        ids, mask = prompts(0)
        g = torch.Generator().manual_seed(3)
        res: dict[str, Any] = {"units": len(units), "same": [], "gathers": [], "released": [], "losses": []}
        for cycle in range(cycles):
            engine.eval()
            counter = GatherCounter()
            try:
                got = engine.generate(ids.to(engine.device), attention_mask=mask.to(engine.device), max_new_tokens=4,
                                      do_sample=False, eos_token_id=None, pad_token_id=PAD)
            finally:
                counter.restore()
            # the engine's current full weights in a single-process copy: the same numbers, so the same tokens
            probe.load_state_dict({n: t.cpu() for b in engine.iter_full_params(bucket_bytes=1 << 20) for n, t in b})
            want = probe.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
                                  pad_token_id=PAD)
            res["same"].append(got.cpu().tolist() == want.tolist())
            res["gathers"].append(counter.count)
            res["released"].append(all(not s.unit.gathered for s in units))
            batch = torch.randint(6, VOCAB, (MICRO, 10), generator=g)  # the same on every rank and for both
            res["losses"].append((step(engine, batch), step(twin, batch)))
            if cycle == 0:
                res["rss_first"] = rss()
        res["rss_last"] = rss()
        out.append(res)
        twin.close()
        engine.close()
    return out
