"""AutoEP on tiny random Hugging Face MoE models (no downloads): each rank trains the model converted by
``expert_parallel`` and, in the same process, the unmodified Hugging Face model on every rank's batch (the
data-parallel reference: mean of the per-rank losses). Run by ``test_autoep.py``'s 2-rank spawn."""

from __future__ import annotations

from typing import Any

import torch

MICRO, SEQ, VOCAB, STEPS = 2, 8, 64, 3
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 64, "initializer_range": 0.2, "output_router_logits": True}  # fmt: skip


def build(family: str) -> Any:
    """A tiny random-initialised causal LM of ``family`` with 4 experts, top-2 (seeded: same on every rank)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**_COMMON, intermediate_size=24, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, router_aux_loss_coef=0.05)  # fmt: skip
        model = tf.MixtralForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**_COMMON, intermediate_size=40, moe_intermediate_size=24,
                                shared_expert_intermediate_size=40, num_key_value_heads=2, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.05,
                                decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**_COMMON, intermediate_size=40, moe_intermediate_size=24, num_key_value_heads=2,
                                head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                router_aux_loss_coef=0.05, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family in ("deepseek_v3", "deepseek_v2"):
        mla = {"intermediate_size": 40, "moe_intermediate_size": 16, "num_key_value_heads": 4, "kv_lora_rank": 16,
               "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
               "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5}  # fmt: skip
        if family == "deepseek_v3":
            model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**_COMMON, **mla, norm_topk_prob=True))
            with torch.no_grad():  # a non-zero correction bias, so the biased choice is exercised
                for layer in model.model.layers[1:]:
                    layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.05, -0.02, 0.01, 0.03]))
        else:
            model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**_COMMON, **mla, topk_method="group_limited_greedy"))
    else:
        raise ValueError(family)
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def config(stage: int, ep: int, clip: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        # stage 3: every parameter partitioned (no persistent small ones), so the expert units really are
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "expert_parallel": {"enabled": True, "autoep_size": ep, **extra},
    }


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _pairs(engine: Any, ref: Any, rank_in_ep: int, ep: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, engine tensor, reference tensor) for every trainable parameter, experts by global index."""
    from dscore.moe.autoep import AutoEPMoELayer

    ref_params = dict(ref.named_parameters())
    out = []
    for mname, m in engine.module.named_modules():
        if isinstance(m, AutoEPMoELayer):
            src = ref.get_submodule(mname).experts
            for local, expert in enumerate(m.deepspeed_moe.experts.deepspeed_experts):
                g = rank_in_ep * m.num_local_experts + local
                out.append((f"{mname}.expert{g}.gate_up", expert.gate_up_proj, src.gate_up_proj[g]))
                out.append((f"{mname}.expert{g}.down", expert.down_proj, src.down_proj[g]))
    for name, p in engine.module.named_parameters():
        if ".deepspeed_moe." not in name:
            out.append((name, p, ref_params[name]))
    return out


def _ref_grad(ref_param: torch.Tensor, ref: Any, name: str) -> torch.Tensor:
    return ref_param.grad if ref_param.grad is not None else torch.zeros_like(ref_param)


def train(
    family: str, stage: int, ep: int = 2, save_dir: str | None = None, clip: float = 0.0, **extra: Any
) -> dict[str, float]:
    """3 steps of the AutoEP engine vs the unmodified model; the largest absolute differences seen."""
    import copy

    import torch.distributed as dist

    import dscore

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(family)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    engine, *_ = dscore.initialize(model=model, config=config(stage, ep, clip, **extra))
    worst = {"logits": 0.0, "router_logits": 0.0, "loss": 0.0}
    if stage < 3:
        worst["weight"] = 0.0
    for step in range(STEPS):
        ids = [batch(r, step) for r in range(world)]
        whole = ref(input_ids=torch.cat(ids), output_router_logits=True)  # the concatenated batch
        outs = [ref(input_ids=i, labels=i, output_router_logits=True) for i in ids]
        ref_opt.zero_grad()
        (sum(o.loss for o in outs) / world).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        res = engine(input_ids=ids[rank], labels=ids[rank], output_router_logits=True)
        if ep > 1:  # the all-to-all really moved tokens: this rank routed some to the other rank's experts
            from dscore.moe.autoep import AutoEPMoELayer

            for m in engine.module.modules():
                if isinstance(m, AutoEPMoELayer):
                    counts = m.deepspeed_moe.exp_counts
                    mine = counts[(rank % ep) * m.num_local_experts : (rank % ep + 1) * m.num_local_experts]
                    assert int(counts.sum() - mine.sum()) > 0, "no token left this rank"
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        worst["logits"] = max(worst["logits"], _diff(res.logits, whole.logits[rows]))
        tok = slice(rank * MICRO * SEQ, (rank + 1) * MICRO * SEQ)
        assert len(res.router_logits) == len(whole.router_logits) > 0, "router logits were not captured"
        for mine, theirs in zip(res.router_logits, whole.router_logits):
            worst["router_logits"] = max(worst["router_logits"], _diff(mine, theirs[tok]))
        if outs[rank].aux_loss is not None:  # Mixtral / Qwen: HF adds router_aux_loss_coef * aux_loss to loss
            assert res.aux_loss is not None and float(res.aux_loss.detach()) > 0, "the auxiliary loss was not computed"
            worst["aux_loss"] = max(worst.get("aux_loss", 0.0), _diff(res.aux_loss, outs[rank].aux_loss))
            # HF's own loss function over every rank's router logits is the concatenated batch's aux loss
            import sys

            lb = sys.modules[type(ref).__module__].load_balancing_loss_func
            gathered = []
            for mine in res.router_logits:
                parts = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(parts, mine.detach().contiguous())
                gathered.append(torch.cat(parts))
            aux_all = lb(tuple(gathered), ref.num_experts, ref.num_experts_per_tok, None)
            worst["aux_loss_concat"] = max(worst.get("aux_loss_concat", 0.0), _diff(aux_all, whole.aux_loss))
        worst["loss"] = max(worst["loss"], _diff(res.loss, outs[rank].loss))
        engine.backward(res.loss)
        pairs = _pairs(engine, ref, rank % ep, ep)
        if stage == 0 and clip == 0:  # stages 1-2 keep the reduced gradients in their partitions
            grads = dict(ref.named_parameters())
            for name, mine, theirs in pairs:
                if ".expert" in name:
                    layer, _, rest = name.partition(".expert")
                    g, _, which = rest.partition(".")
                    src = ref.get_submodule(layer).experts
                    full = (src.gate_up_proj if which == "gate_up" else src.down_proj).grad
                    ref_g = full[int(g)] if full is not None else torch.zeros_like(theirs)
                else:
                    ref_g = _ref_grad(grads[name], ref, name)
                mine_g = mine.grad if mine.grad is not None else torch.zeros_like(mine)
                worst["grad"] = max(worst.get("grad", 0.0), _diff(mine_g, ref_g))
        engine.step()
        ref_opt.step()
        if stage < 3:  # stage 3 holds partitions: its weights are checked through the next forward's logits
            worst["weight"] = max(worst["weight"], max(_diff(a, b) for _, a, b in _pairs(engine, ref, rank % ep, ep)))
    with torch.no_grad():  # the weights after the last step, seen through one more forward (relative to
        ids = batch(rank, STEPS)  # the logits' size: the weights' rounding differences grow through the model)
        want = ref(input_ids=ids).logits
        worst["final_logits_rel"] = _diff(engine(input_ids=ids).logits, want) / float(want.abs().max())
    if save_dir is not None:
        from dscore.moe.autoep import hf_state_dict

        hf = hf_state_dict(engine.module)  # the Hugging Face names and fused shapes again, every expert
        theirs = ref.state_dict()
        assert sorted(hf) == sorted(theirs), sorted(set(hf) ^ set(theirs))
        worst["hf_state_dict"] = max(_diff(hf[k], theirs[k]) for k in theirs)
        engine.save_checkpoint(save_dir, tag="ep2")
        # the same checkpoint at autoep_size 1: every rank holds all 4 experts, loaded from their global names
        model1 = build(family)
        engine1, *_ = dscore.initialize(model=model1, config=config(stage, 1, clip, **extra))
        engine1.load_checkpoint(save_dir, tag="ep2")
        worst["loaded_weight"] = max(_diff(a, b) for _, a, b in _pairs(engine1, ref, 0, 1))
        # one more step from the loaded state on both sides (optimizer state travels too)
        ids = [batch(r, STEPS) for r in range(world)]
        outs = [ref(input_ids=i, labels=i, output_router_logits=True) for i in ids]
        ref_opt.zero_grad()
        (sum(o.loss for o in outs) / world).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        res = engine1(input_ids=ids[rank], labels=ids[rank], output_router_logits=True)
        engine1.backward(res.loss)
        engine1.step()
        worst["loaded_step_weight"] = max(_diff(a, b) for _, a, b in _pairs(engine1, ref, 0, 1))
        engine1.close()
    engine.close()
    return worst


def two_ranks(save_dir: str) -> dict[str, dict[str, float]]:
    """Every scenario in one spawn of the two ranks."""
    return {
        "mixtral-zero0": train("mixtral", 0),
        "qwen2_moe-zero1": train("qwen2_moe", 1),
        "qwen3_moe-zero2-clip": train("qwen3_moe", 2, clip=0.5),
        "deepseek_v3-zero0": train("deepseek_v3", 0),
        "deepseek_v2-zero2": train("deepseek_v2", 2),
        "deepseek_v3-zero3": train("deepseek_v3", 3),
        "mixtral-zero2-ckpt": train("mixtral", 2, save_dir=save_dir),
    }
