"""transformers' from_pretrained under HfDeepSpeedConfig ZeRO-3 (it calls model.state_dict() inside zero.Init)."""

from __future__ import annotations

import os

import frompre_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import torch
import transformers

from dscore.testing import run_distributed


def test_from_pretrained_under_zero3_loads_the_saved_weights_bit_for_bit(tmp_path) -> None:
    """2 ranks: the loaded partitioned weights equal the saved ones exactly, and the first loss equals a
    plain single-process forward of the saved model."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    m = transformers.LlamaForCausalLM(cfg)
    m.save_pretrained(str(tmp_path))
    torch.save({n: p.detach().clone() for n, p in m.named_parameters()}, os.path.join(tmp_path, "ref.pt"))
    ids = torch.tensor([[1, 2, 3, 4, 5]], device="cpu")
    ref = m(input_ids=ids, labels=ids).loss.item()
    results = run_distributed(frompre_jobs.job, 2, str(tmp_path), timeout=300)
    for r in results:
        assert r["same"]
        assert abs(r["losses"][0] - ref) <= 1e-6
