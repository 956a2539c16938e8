"""DeepSpeed 0.19.8 MoE checkpoint: Linear(8,8) -> MoE(4 experts Linear(8,8), ep_size E, k=2) -> Linear(8,4)."""
import json
import os
import sys

import deepspeed
import torch
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

out, name, stage, ep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
deepspeed.init_distributed("gloo")

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=ep, k=2,
                       capacity_factor=4.0, min_capacity=8)
        self.out = torch.nn.Linear(8, 4)
    def forward(self, x):
        h, _, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h)

torch.manual_seed(1234)
model = Net()
groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
       "zero_optimization": {"stage": stage}}
eng, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
def batch(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
for s in range(1, 4):
    x, y = batch(s, rank)
    loss = torch.nn.functional.cross_entropy(eng(x).float(), y)
    eng.backward(loss)
    eng.step()
eng.save_checkpoint(os.path.join(out, name), client_state={"epoch": 2})
sd = {k: v.detach().float().tolist() for k, v in eng.module.state_dict().items()}
with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
    json.dump({"ep_rank": rank % ep, "module": sd}, f)
