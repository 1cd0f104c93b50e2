"""The benchmark's own logic: the engine-alone target, the goal ratios, the table, what the
engine waited for a CPU, what the runs cost in CPU, and the plot."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from bench.engine_alone import EngineTarget
from bench.environment import OthersCpu, Waiting, thread_schedstats
from bench.loadgen import RequestSpec, Summary, run_load
from bench.plot import figure, plot
from bench.run import (
    ADAPTER,
    ADAPTER_CHAT,
    ADAPTER_CHAT_BY_TRITON,
    ENGINE,
    ENGINE_EXPLICIT,
    GRPC,
    GRPC_EXPLICIT,
    GRPC_LOGPROBS,
    PEER,
    Plan,
    goal_ratios,
    median_runs,
    ratios,
    table,
)

ZERO = Summary("", 1, 10, 0, 1000, 1000, 1.0, 0.05, 0.1, 0.01, 0.02, None, 0.0)


def _run(target: str, concurrency: int, tokens_per_s: float, ttft_s: float) -> Summary:
    return replace(
        ZERO,
        target=target,
        concurrency=concurrency,
        output_tokens=int(tokens_per_s),
        ttft_p50=ttft_s,
    )


@pytest.mark.parametrize("logprob_token_ids", [[], [0, 5, 9]])
def test_the_engine_alone_generates_every_planned_token(
    model_dir: Path, logprob_token_ids: list[int]
) -> None:
    target = EngineTarget(model_dir, max_num_seqs=4)
    target.logprob_token_ids = logprob_token_ids
    try:
        specs = [RequestSpec((1, 2, 3 + i), "", 3 + i) for i in range(6)]
        load = asyncio.run(run_load(target, specs, concurrency=4))
    finally:
        target.stop()
    assert [r.error for r in load.requests] == [None] * 6
    assert sorted(r.tokens for r in load.requests) == [3, 4, 5, 6, 7, 8]
    assert all(
        r.first_token is not None and r.start <= r.first_token <= r.end for r in load.requests
    )


def test_ratios_divide_the_right_runs_against_the_goals() -> None:
    plan = Plan((1, 16), 54, 9, (32,), 0.0, 1)
    summaries = [
        _run(ENGINE, 1, 300, 0.01),
        _run(GRPC, 1, 240, 0.01),
        _run(ENGINE, 16, 2000, 0.04),
        replace(_run(ENGINE_EXPLICIT, 16, 1900, 0.04), tpot_p50=ZERO.tpot_p50 * 1.25),
        _run(GRPC, 16, 1000, 0.05),
        _run(ADAPTER, 16, 950, 0.06),
        _run(f"{PEER} (plain) completions", 16, 200, 4.0),
        _run(f"{PEER} (continuous-batching) completions", 16, 500, 0.03),
    ]
    found = {r.what: (r.value, r.met) for r in ratios(plan, summaries)}
    assert found["gRPC / engine alone, output tok/s, C=1"] == (0.8, True)
    assert found["gRPC / engine alone, output tok/s, C=16"] == (0.5, False)
    best = f"{ADAPTER} / {PEER} (continuous-batching) completions, C=16"
    assert found[f"{best}, output tok/s"] == (1.9, True)
    assert math.isclose(found[f"{best}, TTFT p50"][0], 2.0) and not found[f"{best}, TTFT p50"][1]
    assert found["adapter / gRPC output tok/s, C=16"] == (0.95, True)
    assert found["engine alone: 1024 explicit ids / none, TPOT p50, C=16"] == (1.25, False)


def test_the_ids_goal_is_split_into_the_normaliser_and_the_ids() -> None:
    """LOGPROBS=0 / none and ids / LOGPROBS=0 multiply to the goal's ids / none, and have no
    goal of their own."""
    plan = Plan((16,), 54, 9, (32,), 0.0, 1)
    summaries = [
        replace(_run(GRPC, 16, 1000, 0.05), ours_cpu_s=0.5),
        replace(_run(GRPC_LOGPROBS, 16, 900, 0.05), tpot_p50=ZERO.tpot_p50 * 1.5),
        replace(_run(GRPC_EXPLICIT, 16, 800, 0.05), tpot_p50=ZERO.tpot_p50 * 1.8, ours_cpu_s=0.52),
    ]
    found = {r.what: r for r in ratios(plan, summaries)}
    goal = found["1024 explicit ids / none, TPOT p50, C=16"]
    normaliser = found["LOGPROBS=0 / none, TPOT p50, C=16"]
    ids = found["1024 explicit ids / LOGPROBS=0, TPOT p50, C=16"]
    assert math.isclose(goal.value, 1.8) and goal.met is False
    assert math.isclose(normaliser.value, 1.5) and math.isclose(ids.value, 1.2)
    assert normaliser.met is None and ids.met is None
    assert ids.line() == (
        "- 1024 explicit ids / LOGPROBS=0, TPOT p50, C=16: **1.20x** (no goal of its own)"
    )
    # The goal's cost as CPU per token: 0.52 s over 800 tokens against 0.5 s over 1000.
    cpu = found["1024 explicit ids / none, our CPU per token, C=16"]
    assert math.isclose(cpu.value, 1.3) and cpu.met is None


def test_chat_tokenized_in_the_adapter_is_compared_with_preprocessing() -> None:
    plan = Plan((16,), 54, 9, (32,), 0.0, 1)
    summaries = [_run(ADAPTER_CHAT, 16, 900, 0.045), _run(ADAPTER_CHAT_BY_TRITON, 16, 850, 0.06)]
    [found] = ratios(plan, summaries)
    assert found.what == "chat tokenized in the adapter / by preprocessing, TTFT p50, C=16"
    assert math.isclose(found.value, 0.75) and found.met is None


def test_rounds_report_the_median_ratio_and_keep_one_peer_mode() -> None:
    """Each round's ratio pairs runs of that round; the peer's mode is the better by median."""
    plan = Plan((16,), 54, 9, (32,), 0.0, 3)
    plain, batching = f"{PEER} (plain) completions", f"{PEER} (continuous-batching) completions"
    names = (ENGINE, GRPC, ADAPTER, plain, batching)
    rounds = [
        [_run(name, 16, rate, 0.05) for name, rate in zip(names, rates, strict=True)]
        for rates in [
            (2000, 1600, 1500, 900, 800),  # plain is better in this round only
            (1000, 700, 650, 100, 500),
            (1800, 1500, 1360, 100, 850),
        ]
    ]
    assert [run.output_tokens for run in median_runs(rounds)] == [1800, 1500, 1360, 100, 800]
    found = {r.what: r for r in goal_ratios(plan, rounds)}
    engine = found["gRPC / engine alone, output tok/s, C=16"]
    assert (engine.value, engine.low, engine.high, engine.rounds) == (0.8, 0.7, 1500 / 1800, 3)
    # Per round 1500/800, 650/500 and 1360/850: the median is not the medians' ratio (1.7).
    versus_peer = found[f"{ADAPTER} / {batching}, C=16, output tok/s"]
    assert math.isclose(versus_peer.value, 1.6) and versus_peer.met
    assert not any(plain in what for what in found)


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "sweep.png"
    plot(
        [_run(GRPC, c, 100 * c, 0.01 * c) for c in (1, 4, 16)] + [_run(ENGINE, 16, 2000, 0.04)],
        path,
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_each_of_a_sweeps_eleven_scenarios_has_a_colour_of_its_own() -> None:
    names = [f"ours: scenario {index}" for index in range(8)] + [f"{PEER} {i}" for i in range(3)]
    drawn = figure([_run(name, c, 100 * c, 0.01 * c) for name in names for c in (1, 16)])
    rate, ttft = (list(axes.get_lines()) for axes in drawn.axes)
    plt.close(drawn)
    assert [line.get_label() for line in rate] == names
    assert len({line.get_color() for line in rate}) == len(names)
    assert [line.get_color() for line in rate] == [line.get_color() for line in ttft]


def test_the_table_shows_the_served_engines_wait_for_a_cpu_and_the_cpu_per_token() -> None:
    served = replace(_run(GRPC, 16, 900, 0.01), engine_waiting=0.074, ours_cpu_s=0.54)
    rows = table([[_run(ENGINE, 16, 1000, 0.01), served]]).splitlines()
    assert rows[0].endswith("| engine waiting for a CPU | our CPU ms/token |")
    assert rows[2].endswith("| 0% | - | - |")  # not measured: no served engine, no CPU time
    assert rows[3].endswith("| 0% | 7% | 0.600 |")  # 0.54 s over 900 tokens


def test_schedstat_is_read_per_thread_and_waiting_is_a_share_of_the_block() -> None:
    stats = thread_schedstats(os.getpid())
    running, queued = stats[threading.get_native_id()]
    assert running > 0 and queued >= 0
    with Waiting(os.getpid()) as ours:
        sum(range(200_000))  # some CPU, so that the block has a length
    assert 0.0 <= ours.share <= len(stats)  # at most every thread waited throughout
    with Waiting(None) as nothing:
        pass
    assert math.isnan(nothing.share)


def test_others_cpu_keeps_the_cpu_time_of_our_own_processes() -> None:
    with OthersCpu() as cpu:
        start = time.process_time()
        while time.process_time() - start < 0.1:  # 0.1 s of this process's CPU
            pass
    # psutil reads clock ticks (10 ms): the block's delta may lose one at each end.
    assert cpu.ours_s >= 0.08
