"""A small Llama-style decoder (token embedding, RMSNorm, rotary attention, gated MLP, lm_head) for the
tensor- and sequence-parallel tests, plus its data and the single-process reference training loop.

The attention reshapes with ``view(b, s, -1, head_dim)`` (as Hugging Face models do), so a column-split
``q/k/v_proj`` simply yields fewer heads per rank; its core attention is pluggable so Ulysses can wrap it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, LAYERS, FFN = 64, 32, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[b, s, h, d]`` at positions ``pos`` ``[b, s]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    ang = pos.float()[..., None] * freq  # [b, s, half]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sdpa_core(
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface layout: q/k/v ``[b, h, s, d]`` -> (``[b, s, h, d]``, None); causal."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2), None


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=True)  # a row-split bias: added after the all-reduce
        self.core: Any = sdpa_core

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = rope(self.q_proj(x).view(b, s, -1, HEAD_DIM), pos).transpose(1, 2)
        k = rope(self.k_proj(x).view(b, s, -1, HEAD_DIM), pos).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        out, _ = self.core(self, q, k, v, None)
        return self.o_proj(out.reshape(b, s, -1))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, FFN, bias=True)
        self.down_proj = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids)
        return self.lm_head(self.norm(x))


def make_model(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama()
    with torch.no_grad():  # non-trivial norm weights so their gradients matter
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.add_(0.1 * torch.randn_like(p))
    return model


def batches(steps: int, batch: int, seq: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of ``input_ids``/``labels`` ``[batch, seq]``; a few labels are -100 (masked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = ids.clone()
        labels[torch.rand(batch, seq, generator=g) < 0.2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked targets (labels shifted here)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=-100)


#: AdamW settings of both sides. eps 1e-6 rather than 1e-8: Adam divides by sqrt(v) + eps, so for an entry
#: whose gradient is ~1e-8 the last-bit rounding differences between a split and an unsplit sum decide the
#: update; a larger eps keeps the comparison about the gradients, not about Adam's amplification of noise.
ADAMW = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-6}


def reference_dp(steps: int, micro: int, dp: int, seq: int, clip: float = 0.0) -> dict[str, Any]:
    """One process on the full model and sequence. The loss of a step is the mean over ``dp`` shards of
    ``micro`` samples of their token-mean losses (what data-parallel ranks averaging gradients optimise).

    Returns losses, gradient norms (before clipping), first-step logits and gradients, final parameters.
    """
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, norms, logits0, grads0 = [], [], None, {}
    for i, b in enumerate(batches(steps, micro * dp, seq)):
        logits = model(b["input_ids"])
        parts = [
            causal_lm_loss(logits[j * micro : (j + 1) * micro], b["labels"][j * micro : (j + 1) * micro])
            for j in range(dp)
        ]
        loss = torch.stack(parts).mean()
        loss.backward()
        if i == 0:  # before clipping: the engine's gradients are read between backward and step
            logits0 = logits.detach().clone()
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "norms": norms,
        "logits": logits0,
        "grads": grads0,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def ds_config(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
        "gradient_clipping": 0.0,
    }
    cfg.update(extra)
    return cfg
