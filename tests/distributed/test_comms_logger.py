"""The comms logger: DeepSpeed's formulas and table, and the ``comms_logger`` block on 2 real gloo ranks."""

from __future__ import annotations

import pytest

from dscore.comm.comms_logger import CommsLogger, calc_bw_log, convert_size, trim_mean
from dscore.testing import run_distributed


def test_bandwidth_formulas_by_hand() -> None:
    mb = 1_000_000  # bytes moved in 2 ms over 4 ranks
    assert calc_bw_log("all_reduce", mb, 2.0, 4) == pytest.approx((8.0, 6.0))  # 2S/t ; S/t * 2(n-1)/n (Gbps)
    assert calc_bw_log("all_gather_into_tensor", mb, 2.0, 4) == pytest.approx((16.0, 12.0))  # nS/t ; * (n-1)/n
    assert calc_bw_log("reduce_scatter_tensor", mb, 2.0, 4) == pytest.approx((4.0, 3.0))  # S is the whole input
    assert calc_bw_log("broadcast", mb, 2.0, 4) == pytest.approx((4.0, 4.0))
    assert calc_bw_log("barrier", 0, 2.0, 4) == (0.0, 0.0)
    with pytest.raises(ValueError, match="unknown operation"):
        calc_bw_log("all_to_al", mb, 1.0, 2)
    assert [convert_size(b) for b in (0, 1023, 1536, 4 * 1024**2)] == ["0B", "1023.0 B", "1.5 KB", "4.0 MB"]
    assert trim_mean(list(range(10)) + [1000], 0.1) == pytest.approx(sum(range(1, 10)) / 9)  # 1 trimmed each end


def test_prof_ops_filter_and_unknown_names() -> None:
    logger = CommsLogger()
    logger.configure(enabled=True, prof_all=False, prof_ops=["all_reduce"])
    assert logger.wants("all_reduce") and not logger.wants("broadcast")
    logger.start_profiling_op(["broadcast"])
    assert logger.wants("broadcast")
    logger.stop_profiling_op(["all_reduce"])
    assert not logger.wants("all_reduce")
    with pytest.raises(ValueError, match="all_to_all_v"):
        logger.configure(prof_ops=["all_to_all_v"])


def _logged_run(tmp: str) -> dict:
    import contextlib
    import io
    import logging

    import torch
    import torch.nn.functional as F

    import dscore
    import dscore.comm
    from dscore.comm import Comm
    from dscore.comm.comms_logger import get_comms_logger

    rank = torch.distributed.get_rank()
    logger = get_comms_logger()
    logger.reset_data()
    comm = Comm(None, backend="gloo")
    dscore.comm.configure(enabled=True, prof_all=True, prof_ops=[], verbose=False, debug=False)
    x = torch.ones(1000, dtype=torch.float32, device=torch.device("cpu"))
    for _ in range(3):
        comm.all_reduce(x)
    out = torch.empty(512, device=torch.device("cpu"))
    work = comm.all_gather_into_tensor(out, torch.full((256,), float(rank), device=torch.device("cpu")), async_op=True)
    work.wait()
    comm.reduce_scatter_tensor(
        torch.empty(128, device=torch.device("cpu")), torch.ones(256, device=torch.device("cpu"))
    )
    comm.barrier()
    records = logger.get_raw_data()
    # only all_reduce from here on, with the caller's name
    logger.configure(prof_all=False, prof_ops=["all_reduce"], debug=True)
    comm.broadcast(x, src=0)

    def my_caller() -> None:
        comm.all_reduce(torch.ones(4, device=torch.device("cpu")))

    my_caller()
    caught = io.StringIO()
    handler = logging.StreamHandler(caught)
    logging.getLogger("dscore.comm.comms_logger").addHandler(handler)
    logging.getLogger("dscore.comm.comms_logger").setLevel(logging.INFO)
    logger.configure(verbose=True)
    my_caller()
    logging.getLogger("dscore.comm.comms_logger").removeHandler(handler)
    after_filter = logger.get_raw_data()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        stats = dscore.comm.log_summary(show_straggler=True, return_dict=True)

    # the block, through an engine: ZeRO-1 records its collectives; the summary comes from the engine
    dscore.comm.configure(enabled=False, prof_all=True, prof_ops=[], debug=False, verbose=False)
    logger.reset_data()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
        "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_gather_into_tensor"]},
    }
    engine, *_ = dscore.initialize(model=model, config=cfg)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(torch.randn(2, 8)), torch.randn(2, 4)))
        engine.step()
    engine_printed = io.StringIO()
    with contextlib.redirect_stdout(engine_printed):
        engine_stats = engine.print_comms_summary(return_dict=True)
    engine.close()
    dscore.comm.configure(enabled=False, prof_all=True, prof_ops=[], debug=False, verbose=False)
    logger.reset_data()
    return {
        "records": {k: {s: v[0] for s, v in d.items()} for k, d in records.items()},
        "filtered": {k: {s: v[0] for s, v in d.items()} for k, d in after_filter.items()},
        "verbose": caught.getvalue(),
        "printed": printed.getvalue(),
        "stats": stats,
        "engine_ops": {k: {s: v["count"] for s, v in d.items()} for k, d in engine_stats["summary"].items()},
        "engine_printed": engine_printed.getvalue(),
    }


def test_comms_logger_on_two_gloo_ranks(tmp_path) -> None:
    r0, r1 = run_distributed(_logged_run, 2, str(tmp_path), timeout=240)
    expected = {
        "all_reduce": {4000: 3},  # message size: the tensor's bytes
        "all_gather_into_tensor": {1024: 1},  # the input's bytes (async: waited while recorded)
        "reduce_scatter_tensor": {1024: 1},  # the whole input's bytes
        "barrier": {0: 1},
    }
    assert r0["records"] == r1["records"] == expected
    caller = "all_reduce | [Caller Func: my_caller]"
    assert r0["filtered"] == {**expected, caller: {16: 2}}  # broadcast not in prof_ops: not recorded
    assert "comm op: all_reduce | [Caller Func: my_caller] | time (ms):" in r0["verbose"]
    assert "msg size: 16.0 B" in r0["verbose"]
    # rank 0 prints DeepSpeed's table; every rank returns the statistics
    lines = r0["printed"].splitlines()
    assert lines[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total", "Latency(ms)", "Avg",
                                "Latency(ms)", "tput_avg", "(Gbps)", "busbw_avg", "(Gbps)"]  # fmt: skip
    assert "all_reduce" in lines and "3.91 KB" in r0["printed"] and "Breakdown with straggler effect" in r0["printed"]
    assert r1["printed"] == ""
    for stats in (r0["stats"], r1["stats"]):
        row = stats["summary"]["all_reduce"][4000]
        assert row["count"] == 3 and row["msg_size_str"] == "3.91 KB"
        assert row["total_latency_ms"] > 0 and row["tput_avg_gbps"] > 0
        # busbw / algbw = (n - 1) / n for all_reduce's 2S/t and S/t * 2(n-1)/n at n = 2
        assert row["busbw_avg_gbps"] == pytest.approx(row["tput_avg_gbps"] / 2)
        straggle = stats["straggler_analysis"]["all_reduce"][4000]
        assert 0 <= straggle["total_comm_lat_ms"] <= row["total_latency_ms"] + 1e-9
        assert stats["metadata"]["world_size"] == 2
    # engine: the block was read (prof_ops filter), ZeRO-1's parameter all-gathers recorded once per step
    assert (
        list(r0["engine_ops"]) == ["all_gather_into_tensor"]
        and sum(r0["engine_ops"]["all_gather_into_tensor"].values()) >= 2
    )
    assert "all_gather_into_tensor" in r0["engine_printed"] and r1["engine_printed"] == ""
