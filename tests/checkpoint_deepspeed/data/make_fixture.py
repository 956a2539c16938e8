"""Train a tiny model with DeepSpeed 0.19.8 on CPU, save a checkpoint after SAVE_AT steps, keep training to
TOTAL steps, and record what a faithful importer must reproduce. Run one process per rank (env: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). argv: outdir name stage dtype model

A copy of ../shared/fixtures/deepspeed-0.19.8-checkpoints/make_fixture.py (the script that made the shared
fixtures) kept beside the committed ones, reformatted, plus the model kind ``rotary`` (not in the shared
copy: a non-persistent ``inv_freq`` buffer used in forward and a persistent running statistic); run it with a Python that has DeepSpeed 0.19.8
installed (never dscore's), DS_ACCELERATOR=cpu, one process per rank. See README.md here."""

import json
import os
import sys

import deepspeed
import torch

out, name, stage, dtype, model_kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
SAVE_AT, TOTAL, MICRO = 3, 5, 4

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)
    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))

class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))

class Rope(torch.nn.Module):
    # rotary position embedding over a (batch, 4 positions, 4 features) view, as in a Llama's rotary_emb:
    # inv_freq is recomputed by the module and never saved; running_amp is saved (rank 0's is in the file)
    def __init__(self, dim=4, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("running_amp", torch.ones(1, device="cpu"))
    def forward(self, h):
        pos = torch.arange(h.shape[1], dtype=torch.float32, device=h.device)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos().to(h.dtype), ang.sin().to(h.dtype)
        a, b = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
        with torch.no_grad():
            self.running_amp.mul_(0.9).add_(0.1 * h.detach().float().abs().mean())
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.rope = Rope()
        self.fc2 = torch.nn.Linear(16, 4)
    def forward(self, x):
        h = self.rope(self.fc1(x).view(x.shape[0], 4, 4))
        return self.fc2(torch.relu(h.reshape(x.shape[0], 16)))

def batch(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    if model_kind == "tied":
        x = torch.randint(0, 10, (MICRO,), generator=g)
        y = torch.randint(0, 10, (MICRO,), generator=g)
    else:
        x = torch.randn(MICRO, 8, generator=g)
        y = torch.randint(0, 4, (MICRO,), generator=g)
    return x, y

torch.manual_seed(1234)
model = {"tied": Tied, "rotary": Rotary}.get(model_kind, MLP)()
cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
       "steps_per_print": 1000,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}},
       "zero_optimization": {"stage": stage}}
if dtype == "bf16":
    cfg["bf16"] = {"enabled": True}
eng, opt, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ckdir = os.path.join(out, name)
record = {"name": name, "deepspeed": deepspeed.__version__, "torch": torch.__version__, "world_size": ws,
          "zero_stage": stage, "dtype": dtype, "model": model_kind, "micro_batch": MICRO, "save_at": SAVE_AT,
          "total_steps": TOTAL, "config": cfg, "client_state": {"epoch": 2, "note": "fixture", "best": 0.5}}
def full_params():
    # the trained weights as a consolidated fp32 state dict (module names)
    if stage == 3:
        params = list(eng.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            sd = {k: v.detach().float().clone() for k, v in eng.module.state_dict().items()}
    else:
        sd = {k: v.detach().float().clone() for k, v in eng.module.state_dict().items()}
    return {k: v.flatten().tolist() for k, v in sd.items()}
for step in range(1, TOTAL + 1):
    x, y = batch(step, rank)
    dt = torch.bfloat16 if dtype == "bf16" and model_kind != "tied" else None
    if dt is not None:
        x = x.to(dt)
    loss = torch.nn.functional.cross_entropy(eng(x).float(), y)
    eng.backward(loss)
    eng.step()
    if step == SAVE_AT:
        eng.save_checkpoint(ckdir, client_state=record["client_state"])
        record["at_save"] = {"params": full_params(), "lr": eng.get_lr(), "global_steps": eng.global_steps}
record["at_end"] = {"params": full_params(), "lr": eng.get_lr(), "global_steps": eng.global_steps}
if rank == 0:
    with open(os.path.join(out, name + ".expected.json"), "w") as f:
        json.dump(record, f, indent=1)
