"""transformers' from_pretrained under HfDeepSpeedConfig ZeRO-3 (it calls model.state_dict() inside zero.Init)."""

from __future__ import annotations

import os

import frompre_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import torch
import transformers

from dscore.testing import run_distributed


def test_from_pretrained_under_zero3_loads_the_saved_weights_bit_for_bit(tmp_path) -> None:
    """2 ranks: the loaded partitioned weights equal the saved ones exactly, and 2 SGD steps' losses equal
    a plain single-process torch reference of the same updates within 1e-6."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    m = transformers.LlamaForCausalLM(cfg)
    m.save_pretrained(str(tmp_path))
    torch.save({n: p.detach().clone() for n, p in m.named_parameters()}, os.path.join(tmp_path, "ref.pt"))
    ids = torch.tensor([[1, 2, 3, 4, 5]], device="cpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref = []
    for _ in range(2):  # the same updates by hand: DeepSpeed's default gradient_clipping is 1.0
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    results = run_distributed(frompre_jobs.job, 2, str(tmp_path), timeout=300)
    for r in results:
        assert r["same"]
        assert len(r["losses"]) == 2 and all(abs(a - b) <= 1e-6 for a, b in zip(r["losses"], ref))
