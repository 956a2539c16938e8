"""A small decoder-only transformer (GPT), byte-level, readable top to bottom.

Shapes use B = batch, T = sequence length (<= block_size), C = n_embd, H = n_head, V = vocab (256 bytes).
The architecture follows GPT-2 (Radford et al. 2019): pre-LayerNorm blocks of causal self-attention and a
4x MLP with GELU, learned position embeddings, and the output projection tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Model hyper-parameters (the defaults train on 2 CPU cores in a few minutes)."""

    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx, targets)`` returns the mean cross-entropy loss in nats when targets
    are given (idx, targets: int64 (B, T)), else logits (B, T, V) in float."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections: std 0.02 / sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        assert T <= self.cfg.block_size, f"sequence length {T} exceeds block_size {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits.float()
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def pipeline_layers(self) -> list[nn.Module]:
        """This model's modules at the positions of :func:`pipeline_layers` (for
        ``dscore.pipe.load_into_layers``): an embedding stem sharing ``tok_emb``/``pos_emb``, the blocks,
        ``ln_f``, and the stem again for the tied head."""
        stem = nn.Module()
        stem.tok_emb = self.tok_emb
        stem.pos_emb = self.pos_emb
        return [stem, *self.blocks, self.ln_f, stem]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int = 40,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` bytes after ``idx`` (int64 (1, T)); returns (1, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :] / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


# ---------------------------------------------------------------------------------------------------------
# The same model as a pipeline (train.py --pipeline-stages N): layers for dscore.pipe.PipelineModule
# ---------------------------------------------------------------------------------------------------------
class EmbeddingStem(nn.Module):
    """Token + position embeddings (GPT's first step); tied to the output head in the pipeline."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.apply(GPT._init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)


class PipeBlock(Block):
    """A :class:`Block` initialised as :class:`GPT` initialises its blocks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))


def tied_head(stem: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output projection: logits against the token embedding (weight tying)."""
    return x @ stem.tok_emb.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats (the pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def pipeline_layers(cfg: GPTConfig) -> list:
    """GPT as layers for ``dscore.pipe.PipelineModule``: stem, blocks, final LayerNorm, tied head."""
    from dscore.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", EmbeddingStem, cfg),
        *[LayerSpec(PipeBlock, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec("embed", EmbeddingStem, cfg, forward_fn=tied_head),
    ]
