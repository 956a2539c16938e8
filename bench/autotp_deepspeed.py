"""AutoTP training side by side: dscore, DeepSpeed 0.19.8 and one process on the full model (same losses?).

The test suite's Llama-style stack (``tests/distributed/tp_sp_model.py``) trains 3 AdamW steps with
``gradient_clipping: 0.5`` (active: the first gradient norm is above it) on 2 gloo ranks at tp 2, from the
same initial weights and batches. Each side prints one JSON line of per-step losses:

* ``--side reference``: one process, full model (plain PyTorch);
* ``--side dscore``: ``dscore.initialize`` with ``tensor_parallel.autotp_size: 2`` (this repository's venv);
* ``--side deepspeed``: ``deepspeed.initialize`` with the same block, ``DS_ACCELERATOR=cpu`` on gloo, run with
  the bench venv that has DeepSpeed (``/work/venv-ds/bin/python bench/autotp_deepspeed.py --side deepspeed``).
  DeepSpeed is given explicit ``partition_config`` layer specs for q/k/v/gate/up (column) and o/down (row)
  because its parser looks for Hugging Face model classes; ``optimizer.params.torch_adam`` selects
  ``torch.optim.AdamW`` as on the other sides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "distributed"))

STEPS, MICRO, SEQ, CLIP = 3, 2, 16, 0.5
SPECS = [
    {"patterns": [r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"},
]


def _config(deepspeed: bool) -> dict[str, Any]:
    from tp_sp_model import ADAMW

    params: dict[str, Any] = dict(ADAMW)
    if deepspeed:
        params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": SPECS}},
    }


def _losses(engine: Any) -> list[float]:
    from tp_sp_model import batches, causal_lm_loss

    out = []
    for b in batches(STEPS, MICRO, SEQ):
        loss = causal_lm_loss(engine(b["input_ids"]), b["labels"])
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def _dscore_rank() -> list[float]:
    from tp_sp_model import make_model

    import dscore

    engine, _, _, _ = dscore.initialize(model=make_model(), config=_config(False))
    return _losses(engine)


def _deepspeed_rank() -> list[float]:
    import deepspeed
    from tp_sp_model import make_model

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(True))
    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    if shapes["layers.0.self_attn.q_proj.weight"][0] != 16:
        raise RuntimeError(f"DeepSpeed did not split q_proj: {shapes['layers.0.self_attn.q_proj.weight']}")
    return _losses(engine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("reference", "dscore", "deepspeed"), required=True)
    args = parser.parse_args()
    if args.side == "reference":
        from tp_sp_model import reference_dp

        losses = reference_dp(STEPS, MICRO, 1, SEQ, CLIP)["losses"]
    else:
        from dscore.testing import run_distributed

        fn = _dscore_rank if args.side == "dscore" else _deepspeed_rank
        env = {"DS_ACCELERATOR": "cpu"} if args.side == "deepspeed" else {}
        ranks = run_distributed(
            fn, 2, timeout=600, env={**env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        )
        if ranks[0] != ranks[1]:
            raise RuntimeError(f"the two tensor-parallel ranks report different losses: {ranks}")
        losses = ranks[0]
    print(json.dumps({"side": args.side, "losses": losses}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
