"""RLHF library surface on dscore through ``import deepspeed`` (issue 40 item 3): the jobs run on each rank of
a 2-process gloo job and return plain data.

The model is a tiny ``LlamaForCausalLM`` built from a config (no download), fp32, dropout off; every rank
feeds the same batch, so the data-parallel average gradient equals one process's gradient and a plain
single-process copy of the model with the same initial weights is the reference for losses and greedy
generations.
"""

from __future__ import annotations

from typing import Any

from hf_jobs import VOCAB, tiny_llama_config

LR = 1e-3


def _batches(n: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (2, 12), generator=g) for _ in range(n)]


def _greedy(model: Any, prompt: Any) -> list[list[int]]:
    out = model.generate(prompt, attention_mask=prompt.new_ones(prompt.shape), max_new_tokens=6, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return [list(map(int, row)) for row in out]


def trl_generation_job() -> dict[str, Any]:
    """Accelerate-prepared ZeRO-3 Llama: one training step, TRL's own ``unwrap_model_for_generation`` (greedy
    ``generate`` on the gathered model without stage-3 hooks), two more steps. Returns the losses and
    generations of the engine and of the single-process reference, and what the hooks looked like."""
    import copy

    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, set_seed
    from transformers import LlamaForCausalLM
    from trl.models.utils import unwrap_model_for_generation

    from dscore.zero import ZeroParamStatus

    PartialState(cpu=True)
    set_seed(3)
    model = LlamaForCausalLM(tiny_llama_config())
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        # 0: no unit is persistent, so every parameter is really partitioned and released between uses
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    })
    accelerator = Accelerator(deepspeed_plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, optimizer = accelerator.prepare(model, optimizer)
    batches = _batches(3)
    prompt = batches[0][:, :4]

    def train(batch: Any) -> tuple[float, float]:
        out = engine(input_ids=batch, labels=batch)
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return float(out.loss.detach()), float(ref_loss.detach())

    losses = [train(batches[0])]
    offload = engine.optimizer.parameter_offload
    hooks_before = len(offload.forward_hooks)
    weight = engine.module.model.layers[0].mlp.up_proj.weight
    with unwrap_model_for_generation(engine, accelerator) as unwrapped:
        hooks_inside = len(offload.forward_hooks)
        status_inside = weight.ds_status
        generated = _greedy(unwrapped, prompt)
    with torch.no_grad():
        ref_generated = _greedy(reference, prompt)
    hooks_after = len(offload.forward_hooks)
    status_after = weight.ds_status
    invalid_after = offload.param_coordinator.is_invalid_trace()
    losses += [train(b) for b in batches[1:]]
    accelerator.end_training()
    return {
        "losses": losses, "generated": generated, "ref_generated": ref_generated,
        "hooks": (hooks_before, hooks_inside, hooks_after),
        "status": (status_inside is ZeroParamStatus.AVAILABLE, status_after is ZeroParamStatus.NOT_AVAILABLE),
        "invalid_trace_after": invalid_after,
        "valid_trace_after_training": not offload.param_coordinator.is_invalid_trace(),
    }


def openrlhf_offload_job(stage: int) -> dict[str, Any]:
    """OpenRLHF's state offload around generation, through ``deepspeed.initialize`` at ZeRO ``stage``, bf16
    (fp32 masters apart from the bf16 parameters): two engines from the same weights train the same batches;
    one of them, between training phases, moves states through ``engine.optimizer.offload_states(include=
    [optim_states, contiguous_grad_buffer, hp_params], device=OffloadDeviceEnum.cpu, pin_memory=True,
    non_blocking=True)`` + ``engine.empty_partition_cache()`` and back with ``engine.reload_states(
    non_blocking=True)`` (OpenRLHF's offload/reload_deepspeed_states), then everything through
    ``engine.optimizer.offload_states()`` / ``engine.optimizer.reload_states()``. Returns what was moved
    (kinds, bytes per kind, device bytes left behind), the refusals while moved, and whether the two
    engines' weights stayed equal bit for bit."""
    import copy

    import deepspeed
    import torch
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    model = LlamaForCausalLM(tiny_llama_config())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000},
    }
    plain, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=copy.deepcopy(config))
    moved, optimizer, *_ = deepspeed.initialize(model=model, config=config)
    batches = _batches(5)

    def train(engines: list[Any], batch: Any) -> None:
        for engine in engines:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()

    def device_bytes_left(kinds: list[str]) -> int:
        tensors = moved.zero_stage_impl.offload_state_tensors()
        return sum(t.untyped_storage().nbytes() for k in kinds for t in tensors.get(k, []) if t is not None)

    def refused(call: Any) -> str:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return f"{type(exc).__name__}: {exc}"
        return ""

    out: dict[str, Any] = {"optimizer_is_engines": optimizer is moved.optimizer}
    initial = {k: v.clone() for k, v in plain.zero_stage_impl.module_state_dict().items()}
    train([plain, moved], batches[0])
    train([plain, moved], batches[1])
    include = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
               OffloadStateTypeEnum.hp_params]
    moved.optimizer.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
    moved.empty_partition_cache()
    offloader = moved.__dict__["_state_offloader"]
    out["first"] = {
        "offloaded": sorted(offloader.offloaded),
        "bytes": offloader.bytes_by_kind(),
        "left": device_bytes_left(["optim_states", "hp_params"]),
        "forward": refused(lambda: moved(input_ids=batches[2], labels=batches[2])),
        "step": refused(moved.step),
    }
    moved.reload_states(non_blocking=True)
    train([plain, moved], batches[2])
    train([plain, moved], batches[3])
    moved.optimizer.offload_states()  # every kind, DeepSpeed's defaults (device cpu, pinned, blocking)
    out["second"] = {
        "offloaded": sorted(offloader.offloaded),
        "left": device_bytes_left(["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]),
        "nvme": refused(lambda: moved.optimizer.offload_states(device=OffloadDeviceEnum.nvme)),
        "unknown": refused(lambda: moved.optimizer.offload_states(include=["optim_state"])),
    }
    moved.optimizer.reload_states()
    out["reloaded"] = sorted(offloader.offloaded)
    train([plain, moved], batches[4])
    a, b = plain.zero_stage_impl.module_state_dict(), moved.zero_stage_impl.module_state_dict()
    out["same"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    out["trained"] = not all(torch.equal(a[k], initial[k]) for k in a)
    plain.destroy()
    moved.destroy()
    return out
