"""ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``) on 4 gloo ranks under ZeRO-3.

With hpz 2 the ranks form the blocks {0, 1} and {2, 3}. Every variant (fp32, bf16, bf16 with quantized
weights, the latter with ``offload_param``) trains 3 optimizer steps of 2 micro steps and must equal plain
ZeRO-3 (hpz 1) bit for bit (losses, weights). Every ``all_gather_into_tensor`` is recorded with the group it
ran on and the phase (forward of the first / a later micro step, backward): with hpz 2 the first forward
after each step gathers over the 4 ranks and everything after it over the 2-rank blocks, and the very first
forward inside the blocks (copies kept from construction) — the pattern DeepSpeed 0.19.8 shows on the same
model (measured in a scratch run); gradients stay reduced over all 4.
A checkpoint saved with hpz 2 loads at hpz 1 and the reverse (the secondary partitions are not state).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from dscore.testing import run_distributed

STEPS, GAS = 3, 2


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    # odd widths: the units' flat buffers are padded, the secondary pieces cut inside parameters
    return torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 36), torch.nn.GELU(), torch.nn.Linear(36, 8)
    )


def _config(hpz: int, dtype: str, quantized: bool, offload: bool = False) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        # nothing persistent and nothing kept from forward to backward: every unit is re-gathered in backward
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                              "zero_hpz_partition_size": hpz, "zero_quantized_weights": quantized},
    }  # fmt: skip
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload:  # partitions (and hpZ's secondary ones) in host memory, copied to the device per gather
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": False}
    return cfg


class _GatherLog:
    """Records every ``Comm.all_gather_into_tensor``: (phase, global ranks of its group, output bytes)."""

    def __init__(self) -> None:
        from dscore.comm import Comm

        self.phase = ""
        self.rows: list[tuple[str, tuple[int, ...], int]] = []
        self._orig = Comm.all_gather_into_tensor
        log = self

        def recording(comm: Any, output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
            import torch.distributed as dist

            if log.phase:
                g = group if group is not None else comm.group
                ranks = tuple(dist.get_process_group_ranks(g)) if g is not None else tuple(range(dist.get_world_size()))
                log.rows.append((log.phase, ranks, output.numel() * output.element_size()))
            return log._orig(comm, output, input, group=group, async_op=async_op)

        Comm.all_gather_into_tensor = recording  # type: ignore[method-assign]

    def close(self) -> None:
        from dscore.comm import Comm

        Comm.all_gather_into_tensor = self._orig  # type: ignore[method-assign]

    def bytes_by(self) -> dict[str, dict[tuple[int, ...], int]]:
        out: dict[str, dict[tuple[int, ...], int]] = {}
        for phase, ranks, n in self.rows:
            out.setdefault(phase, {}).setdefault(ranks, 0)
            out[phase][ranks] += n
        return out


def _batch(rank: int, step: int, micro: int, dtype: Any) -> tuple[Any, Any]:
    """The same micro batches every step (a fitting curve: the loss must fall)."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(4, 24, generator=g).to(dtype), torch.randn(4, 8, generator=g)


def _train(hpz: int, dtype: str, quantized: bool, offload: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    import dscore

    engine, *_ = dscore.initialize(model=_model(), config=_config(hpz, dtype, quantized, offload))
    stage = engine.zero_stage_impl
    rank = engine.global_rank
    xdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    log = _GatherLog()
    losses = []
    kept = 0
    kinds: set[str] = set()
    try:
        for step in range(STEPS):
            for micro in range(GAS):
                x, y = _batch(rank, step, micro, xdtype)
                log.phase = ("forward-start" if step == 0 else "forward-first") if micro == 0 else "forward-later"
                loss = F.mse_loss(engine(x).float(), y)
                log.phase = "backward"
                engine.backward(loss)
                log.phase = ""
                kept = max(kept, stage.partition_bytes()["parameters"])
                if stage.hpz is not None:  # what the secondary partitions hold after a backward
                    kinds.update(str(sec.kind) for sec in stage.hpz.secondaries)
                engine.step()
                losses.append(float(loss.detach()))
    finally:
        log.close()
    from dscore.parallel import groups
    from dscore.runtime.context import use_runtime

    with use_runtime(engine.runtime):  # DeepSpeed's accessors of the hpZ group
        group_ranks = (groups.get_zero_param_intra_parallel_group_ranks(),
                       groups.get_zero_param_intra_parallel_group_world_size())
    weights = {k: v.float() for k, v in stage.module_state_dict().items()}  # exact gathers
    engine.close()
    return {"losses": losses, "weights": weights, "bytes": log.bytes_by(), "kept": kept, "kinds": sorted(kinds),
            "group": group_ranks}


def _all_variants() -> dict:
    """Each variant at hpz 1 and 2, compared on this rank (tensors stay in the rank process)."""
    import torch

    out = {}
    for dtype, quantized, offload in (("fp32", False, False), ("bf16", False, False), ("bf16", True, False),
                                      ("bf16", True, True)):
        base, hier = _train(1, dtype, quantized, offload), _train(2, dtype, quantized, offload)
        out[f"{dtype}{'+qwZ' if quantized else ''}{'+offload_param' if offload else ''}"] = {
            "same_weights": [k for k in base["weights"] if not torch.equal(base["weights"][k], hier["weights"][k])],
            **{f"{k}{h}": r[k] for h, r in ((1, base), (2, hier)) for k in ("losses", "bytes", "kept", "kinds", "group")},
        }
    return out


def test_hpz_equals_zero3_bit_for_bit_and_gathers_backward_in_blocks(four_ranks: list[dict]) -> None:
    results = [r["variants"] for r in four_ranks]
    world, blocks = (0, 1, 2, 3), {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["losses2"] == r["losses1"], (name, rank)  # bit for bit
            assert r["same_weights"] == [], (name, rank, r["same_weights"])  # names of differing weights
            assert r["losses2"][-GAS] < r["losses2"][0]  # it trains (same micro batch, 2 steps later)
            # plain ZeRO-3: every gather over the 4 ranks
            base, hb = r["bytes1"], r["bytes2"]
            assert set(base) == {"forward-start", "forward-first", "forward-later", "backward"}
            assert all(set(b) == {world} for b in base.values()), (name, base)
            # hpZ, as DeepSpeed: copies kept from construction, so the very first forward gathers inside the
            # rank's block; the first forward after each step over the 4 ranks, the rest inside the block
            assert set(hb["forward-start"]) == {blocks[rank]}, (name, hb)
            assert set(hb["forward-first"]) == {world}, (name, hb)
            assert set(hb["forward-later"]) == {blocks[rank]}, (name, hb)
            assert set(hb["backward"]) == {blocks[rank]}, (name, hb)
            # the same values move: a block gathers as many bytes as the whole group did
            for phase in ("forward-start", "forward-first", "forward-later", "backward"):
                assert sum(hb[phase].values()) == sum(base[phase].values()), (name, phase)
            assert r["kept2"] > r["kept1"]  # the secondary partitions cost memory
            assert r["kinds2"] == (["quantized"] if "qwZ" in name else ["exact"]), (name, r["kinds2"])
            assert r["group1"] == ([rank], 1) and r["group2"] == (list(blocks[rank]), 2), (r["group1"], r["group2"])
    print("rank 0 all_gather output bytes per phase and group:",
          {n: {"hpz1": r["bytes1"], "hpz2": r["bytes2"], "kept": (r["kept1"], r["kept2"])} for n, r in results[0].items()})


def _checkpoint_roundtrip(save_dir: str) -> dict:
    """Train 2 steps at one hpz, save; load at the other hpz; both halve a weight through
    ``GatheredParameters`` and train 1 more step: same bits (kept hpZ copies were dropped when the weights
    changed under them: by the load, by the user's edit)."""
    import torch
    import torch.nn.functional as F

    import dscore

    out = {}
    rank = int(os.environ["RANK"])
    for saved_at, loaded_at in ((2, 1), (1, 2)):
        tag = f"hpz{saved_at}"
        engines = {}
        for which, hpz in (("saver", saved_at), ("loader", loaded_at)):
            engines[which], *_ = dscore.initialize(model=_model(), config=_config(hpz, "bf16", False))
        saver, loader = engines["saver"], engines["loader"]
        for step in range(2):
            for micro in range(GAS):
                x, y = _batch(rank, step, micro, torch.bfloat16)
                saver.backward(F.mse_loss(saver(x).float(), y))
                saver.step()
        saver.save_checkpoint(save_dir, tag=tag)
        x0, _ = _batch(rank, 0, 0, torch.bfloat16)
        with torch.no_grad():  # with hpz 2 the loader keeps copies of its initial weights: loading drops them
            loader(x0)
        loader.load_checkpoint(save_dir, tag=tag)
        losses: dict[str, list[float]] = {}
        kept: dict[str, list[str]] = {}
        for which, engine in engines.items():
            with torch.no_grad():  # fresh hpZ copies; then a user edit (write_back) must drop them
                engine(x0)
            hpz = engine.zero_stage_impl.hpz
            kept[which] = sorted({str(sec.kind) for sec in hpz.secondaries}) if hpz is not None else []
            with dscore.zero.GatheredParameters(list(engine.module[0].parameters()), modifier_rank=0):
                for p in engine.module[0].parameters():
                    p.data.mul_(0.5)
            losses[which] = []
            for micro in range(GAS):
                x, y = _batch(rank, 2, micro, torch.bfloat16)
                loss = F.mse_loss(engine(x).float(), y)
                engine.backward(loss)
                engine.step()
                losses[which].append(float(loss.detach()))
        w = {which: e.zero_stage_impl.module_state_dict() for which, e in engines.items()}
        same = all(torch.equal(w["saver"][k], w["loader"][k]) for k in w["saver"])
        out[tag] = {"losses": losses, "same_weights": same, "kept": kept}
        for e in engines.values():
            e.close()
    return out


def test_checkpoints_load_across_hpz(four_ranks: list[dict]) -> None:
    for res in four_ranks:
        for tag, r in res["checkpoints"].items():
            assert r["losses"]["saver"] == r["losses"]["loader"], tag
            assert r["same_weights"], tag
            hpz2 = "saver" if tag == "hpz2" else "loader"
            assert r["kept"][hpz2] == ["exact"], r["kept"]  # the copies the edit had to drop existed


def _refusal(cfg_block: dict) -> str:
    import dscore
    from dscore.errors import ConfigError

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, **cfg_block}}  # fmt: skip
    try:
        dscore.initialize(model=_model(), config=cfg)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def _job(save_dir: str) -> dict:
    """Everything this module checks on 4 ranks, in one job (a rank's first engine costs the most)."""
    return {
        "variants": _all_variants(),
        "checkpoints": _checkpoint_roundtrip(save_dir),
        "refusals": {hpz: _refusal({"zero_hpz_partition_size": hpz}) for hpz in (3, 8)},
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_job, 4, str(tmp_path_factory.mktemp("hpz_ckpt")), timeout=900)


def test_hpz_must_divide_the_group(four_ranks: list[dict]) -> None:
    for res in four_ranks:
        for hpz, msg in res["refusals"].items():  # 3 does not divide 4; 8 is more than the world
            assert f"zero_optimization.zero_hpz_partition_size {hpz} must divide" in msg, msg
            assert "4 ranks" in msg and "valid sizes here: [1, 2, 4]" in msg, msg


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ({"stage": 2, "zero_hpz_partition_size": 2}, "needs zero_optimization.stage 3, not 2"),
        ({"stage": 1, "zero_hpz_partition_size": 4}, "needs zero_optimization.stage 3, not 1"),
        ({"zero_hpz_partition_size": 2, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, '"nvme"'),
        ({"zero_hpz_partition_size": -1}, "greater than or equal to 0"),
    ],
)
def test_invalid_hpz_configs_are_refused(block: dict, match: str) -> None:
    from dscore.config import load_config
    from dscore.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as info:
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, **block}})
    assert "zero_optimization.zero_hpz_partition_size" in str(info.value)


def test_hpz_off_values_are_accepted() -> None:
    from dscore.config import load_config

    for hpz in (0, 1):  # DeepSpeed's ge=0: both mean off, at any stage
        cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 1, "zero_hpz_partition_size": hpz}})
        assert cfg.section("zero_optimization").zero_hpz_partition_size == hpz


def test_hpz_groups_are_contiguous_blocks_of_the_zero_group() -> None:
    from dscore.parallel.mesh import MeshShape

    shape = MeshShape.of(8)
    assert [shape.zero_param_ranks(r, 2) for r in (0, 1, 2, 7)] == [[0, 1], [0, 1], [2, 3], [6, 7]]
    assert shape.zero_param_ranks(5, 4) == [4, 5, 6, 7]
    # with tensor parallelism the ZeRO group is the ranks of one tp index; its blocks stay neighbours
    tp2 = MeshShape.of(8, tp=2)
    assert tp2.zero_param_ranks(0, 2) == [0, 2] and tp2.zero_param_ranks(5, 2) == [5, 7]
    from dscore.errors import ConfigError

    with pytest.raises(ConfigError, match="valid sizes here: \\[1, 2, 4\\]"):
        tp2.zero_param_ranks(0, 3)
