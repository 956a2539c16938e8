"""2-rank job: from_pretrained under HfDeepSpeedConfig ZeRO-3 (test_from_pretrained_zero3.py)."""
import os

import torch


def job(tmp):
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    keep = HfDeepSpeedConfig(cfg)  # noqa: F841  (transformers holds it weakly: keep it alive)
    m = transformers.LlamaForCausalLM.from_pretrained(tmp)
    saved = torch.load(os.path.join(tmp, "ref.pt"))
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    same = True
    for n, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            same &= torch.equal(p.detach().clone(), saved[n])
    ids = torch.tensor([[1, 2, 3, 4, 5]], device="cpu")
    losses = []
    for _ in range(2):
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return {"same": bool(same), "losses": losses}
