"""`python -m bench.run`: our stack and `transformers serve` under the same load, side by side.

Starts everything it measures on free loopback ports and stops it again (also on Ctrl-C,
SIGTERM and errors): the engine alone in this process, tritonserver with the `llm` model
(gRPC), the OpenAI adapter in front of it (completions and chat), and `transformers serve` on
the same model folder in its plain mode and with `--continuous-batching` (completions and
chat). Each scenario runs at every concurrency of the sweep on the same fixed mix of prompt and
output lengths, after a short warm-up.

The machine is shared and its speed drifts by tens of percent over minutes, so the scenarios are
measured in rounds, one run of each per round (the order reversed every other round), with
every server up throughout (an idle one takes under 1% of a CPU). A goal's ratio is taken in
each round between runs seconds apart, and the median over rounds is reported. Prints one table
(each scenario's median run, with how long the served engine waited for a CPU) and the ratios
against the goals; `--results` appends them to bench/RESULTS.md and `--plot` draws tok/s and p50
TTFT against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import math
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from backend import adapter_server, default_model
from backend.adapter_server import AdapterServer
from backend.engine_process import engine_of
from backend.processes import ChildProcess, free_port
from backend.repository import write_repository
from backend.tritonserver import TritonServer
from bench.engine_alone import EngineTarget
from bench.environment import OthersCpu, Waiting, describe_machine, wait_until_quiet
from bench.loadgen import (
    EXPLICIT_ID_COUNT,
    OUTPUT_LENGTHS,
    PROMPT_LENGTHS,
    OpenAITarget,
    RequestSpec,
    Summary,
    Target,
    TritonTarget,
    explicit_ids,
    make_workload,
    run_load,
)
from bench.plot import plot

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE = "ours: engine alone"
ENGINE_EXPLICIT = f"ours: engine alone + {EXPLICIT_ID_COUNT} ids"
GRPC = "ours: Triton gRPC (llm)"
GRPC_EXPLICIT = f"ours: Triton gRPC + {EXPLICIT_ID_COUNT} ids"
GRPC_LOGPROBS = "ours: Triton gRPC + LOGPROBS=0"
"""The sampled token's logprob only: the log-normaliser over the vocabulary that every logprob
needs, without the ids. It splits the ids' goal into what any logprob costs and what they add."""
ADAPTER = "ours: adapter completions"
ADAPTER_CHAT = "ours: adapter chat"
ADAPTER_CHAT_BY_TRITON = "ours: adapter chat, tokenized by preprocessing"
"""Chat through an adapter with `local_preprocessing` off: the `preprocessing` round trip that
tokenizing in the adapter saves, measured beside it (docs/design.md, "Tokenizing in the
adapter")."""
PEER = "transformers serve"
REFERENCE_CONCURRENCY = 16  # where the goals are set
WARMUP_TOKENS = 8
NOISY = 0.1  # others' CPU share above which a run is flagged


class PeerServer(ChildProcess):
    """`transformers serve` on `port`; SIGINT is uvicorn's graceful shutdown."""

    name = "transformers serve"
    stop_signal = signal.SIGINT

    def __init__(self, model: Path, port: int, continuous_batching: bool, log_path: Path) -> None:
        super().__init__(log_path)
        self.model = model
        self.port = port
        self.continuous_batching = continuous_batching

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ready_url(self) -> str:
        return f"{self.base_url}/health"

    def command(self) -> list[str]:
        transformers = str(Path(sys.executable).parent / "transformers")
        command = [transformers, "serve", str(self.model), "--device", "cpu"]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        return [*command, "--continuous-batching"] if self.continuous_batching else command


@dataclass(frozen=True)
class Plan:
    """How many requests at which concurrency. The engine gets a slot for each request of the
    largest concurrency; the goals are read at `reference` (16 when swept)."""

    concurrencies: tuple[int, ...]
    requests: int
    serial_requests: int
    output_lengths: tuple[int, ...]
    quiet_wait_s: float
    rounds: int

    @property
    def max_num_seqs(self) -> int:
        return max(self.concurrencies)

    @property
    def reference(self) -> int:
        if REFERENCE_CONCURRENCY in self.concurrencies:
            return REFERENCE_CONCURRENCY
        return self.max_num_seqs

    def count(self, concurrency: int) -> int:
        """At least two rounds of `concurrency` requests, so a run is not all ramp."""
        if concurrency == 1:
            return self.serial_requests
        return max(self.requests, 2 * concurrency)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument(
        "--requests", type=int, default=54, help="requests per run at concurrency > 1"
    )
    parser.add_argument("--serial-requests", type=int, default=9, help="requests at concurrency 1")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64],
        help="concurrencies every scenario runs at; the largest is the engine's max_num_seqs",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face causal-LM folder (default: the generated default model)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 16 + 3 requests, outputs of 4..16 tokens, one attempt, no waits",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="before each measured run, wait up to this long for other processes to use under "
        f"{100 * NOISY:.0f}%% of the CPUs (a shared machine)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measured runs of each scenario, one per round; medians are reported",
    )
    parser.add_argument(
        "--llm-parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an `llm` config.pbtxt parameter for our stack (docs/configuration.md); repeatable",
    )
    parser.add_argument(
        "--adapter-nice",
        type=int,
        default=adapter_server.NICE,
        help="the adapter's niceness, as the launcher's flag of that name",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the `transformers serve` runs")
    parser.add_argument("--no-chat", action="store_true", help="skip the chat endpoint runs")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="draw output tok/s and p50 TTFT against concurrency into this file",
    )
    parser.add_argument(
        "--results",
        action="store_true",
        help=f"append a section to {RESULTS.relative_to(REPO_ROOT)}",
    )
    return parser.parse_args(argv)


def llm_parameters(args: argparse.Namespace) -> dict[str, str]:
    """`--llm-parameter NAME=VALUE` flags as a mapping."""
    pairs = [item.partition("=") for item in args.llm_parameter]
    bad = [name for name, equals, _ in pairs if not name or not equals]
    if bad:
        raise SystemExit(f"--llm-parameter takes NAME=VALUE, got {args.llm_parameter}")
    return {name: value for name, _, value in pairs}


def make_plan(args: argparse.Namespace) -> Plan:
    concurrencies = tuple(sorted(set(args.concurrency)))
    if args.quick:
        return Plan(concurrencies, 8, 3, (4, 8, 16), 0.0, 1)
    return Plan(
        concurrencies,
        args.requests,
        args.serial_requests,
        OUTPUT_LENGTHS,
        args.wait_quiet,
        max(args.rounds, 1),
    )


@dataclass(frozen=True)
class Scenario:
    """One row of the table: a target at a concurrency. `make` returns the target of one run
    (a run closes its target; the engine alone is one target that outlives its runs).
    `engine_pid`: the served engine's process, whose waits for a CPU the run records."""

    name: str
    concurrency: int
    make: Callable[[], Target]
    engine_pid: int | None = None


def _scenario_order(positions: range, round_index: int) -> list[int]:
    """Every other round runs backwards, so that a drift within a round favours no scenario."""
    return list(positions if round_index % 2 == 0 else reversed(positions))


async def warm_up(target: Target, specs: Sequence[RequestSpec], concurrency: int) -> None:
    """`concurrency` short requests; raises if one fails. Closes the target."""
    try:
        warmup = [replace(s, max_tokens=WARMUP_TOKENS) for s in specs[:concurrency]]
        failed = [
            r.error for r in (await run_load(target, warmup, concurrency)).requests if r.error
        ]
        if failed:
            raise RuntimeError(f"{target.name}: the warm-up failed: {failed[0]}")
    finally:
        await target.aclose()


async def measure(
    target: Target,
    specs: Sequence[RequestSpec],
    concurrency: int,
    plan: Plan,
    engine_pid: int | None = None,
) -> Summary:
    """One measured run, after a bounded wait for a quiet machine. Closes the target."""
    try:
        if plan.quiet_wait_s > 0:
            await asyncio.to_thread(wait_until_quiet, plan.quiet_wait_s, NOISY)
        with OthersCpu() as others, Waiting(engine_pid) as waiting:
            load = await run_load(target, specs, concurrency)
    finally:
        await target.aclose()
    run = replace(
        Summary.from_load(load),
        others_cpu=others.share,
        engine_waiting=waiting.share,
        ours_cpu_s=others.ours_s,
    )
    print(
        f"  {target.name:<48} C={concurrency:<3} {run.output_tokens_per_s:7.1f} tok/s, "
        f"others used {100 * others.share:.0f}% of the CPUs",
        flush=True,
    )
    return run


def run_rounds(
    scenarios: Sequence[Scenario], specs: Mapping[int, Sequence[RequestSpec]], plan: Plan
) -> list[list[Summary]]:
    """Each scenario warmed up once, then `plan.rounds` rounds of one run each; the runs of a
    round come back in `scenarios`' order."""
    for scenario in scenarios:
        c = scenario.concurrency
        asyncio.run(warm_up(scenario.make(), specs[c], c))
    rounds = []
    for index in range(plan.rounds):
        print(f"round {index + 1} of {plan.rounds}", flush=True)
        runs = {}
        for position in _scenario_order(range(len(scenarios)), index):
            scenario = scenarios[position]
            c = scenario.concurrency
            runs[position] = asyncio.run(
                measure(scenario.make(), specs[c], c, plan, scenario.engine_pid)
            )
        rounds.append([runs[position] for position in range(len(scenarios))])
    return rounds


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def adapter_target(
    base_url: str, chat: bool, concurrency: int, name: str | None = None
) -> OpenAITarget:
    return OpenAITarget(
        base_url,
        "bench",
        name or (ADAPTER_CHAT if chat else ADAPTER),
        chat=chat,
        token_ids=True,
        extra={"ignore_eos": True, "stream_options": {"include_usage": True}},
        concurrency=concurrency,
    )


def _engine_view(engine: EngineTarget, name: str, ids: list[int]) -> Callable[[], Target]:
    """The shared engine, named and asking for `ids` for the run about to start."""

    def make() -> Target:
        engine.name, engine.logprob_token_ids = name, ids
        return engine

    return make


def scenarios(
    plan: Plan,
    engine: EngineTarget,
    grpc_url: str,
    adapter_url: str,
    peers: Mapping[str, str],
    model: Path,
    vocab_size: int,
    chat: bool,
    engine_pid: int | None = None,
    adapter_by_triton_url: str | None = None,
) -> list[Scenario]:
    """Every scenario, those a goal compares next to each other: per concurrency the engine
    alone, gRPC, (the explicit ids at the reference one), the adapter (and, at the reference
    one, chat through `adapter_by_triton_url`), then each peer mode. `peers`: base URL by
    mode; `engine_pid`: the served engine's process."""
    ids = explicit_ids(vocab_size)
    endpoints = (False, True) if chat else (False,)
    out: list[Scenario] = []
    for c in plan.concurrencies:
        out += [
            Scenario(ENGINE, c, _engine_view(engine, ENGINE, [])),
            Scenario(GRPC, c, lambda: TritonTarget(grpc_url, name=GRPC), engine_pid),
        ]
        if c == plan.reference:
            out += [
                Scenario(ENGINE_EXPLICIT, c, _engine_view(engine, ENGINE_EXPLICIT, ids)),
                Scenario(
                    GRPC_EXPLICIT,
                    c,
                    lambda: TritonTarget(grpc_url, logprob_token_ids=ids, name=GRPC_EXPLICIT),
                    engine_pid,
                ),
                Scenario(
                    GRPC_LOGPROBS,
                    c,
                    lambda: TritonTarget(grpc_url, logprobs=0, name=GRPC_LOGPROBS),
                    engine_pid,
                ),
            ]
        for is_chat in endpoints:
            name = ADAPTER_CHAT if is_chat else ADAPTER
            make = functools.partial(adapter_target, adapter_url, is_chat, c)
            out.append(Scenario(name, c, make, engine_pid))
        if chat and c == plan.reference and adapter_by_triton_url is not None:
            name = ADAPTER_CHAT_BY_TRITON
            make = functools.partial(adapter_target, adapter_by_triton_url, True, c, name)
            out.append(Scenario(name, c, make, engine_pid))
        for mode, url in peers.items():
            for is_chat in endpoints:
                name = f"{PEER} ({mode}) {'chat' if is_chat else 'completions'}"
                make = functools.partial(
                    OpenAITarget, url, str(model), name, chat=is_chat, concurrency=c
                )
                out.append(Scenario(name, c, make))
    return out


def run_all(
    model: Path,
    plan: Plan,
    specs: Mapping[int, Sequence[RequestSpec]],
    tmp: Path,
    vocab_size: int,
    chat: bool,
    peer: bool,
    llm_parameters: Mapping[str, str],
    adapter_nice: int,
) -> list[list[Summary]]:
    """Starts every server, then runs the rounds (`run_rounds`)."""
    repository = write_repository(
        tmp / "model_repository",
        model,
        {"max_num_seqs": str(plan.max_num_seqs), **llm_parameters},
    )
    engine = EngineTarget(model, plan.max_num_seqs, name=ENGINE)
    with contextlib.ExitStack() as servers:
        servers.callback(engine.stop)
        triton = servers.enter_context(
            TritonServer(repository, 0, 0, 0, log_path=tmp / "tritonserver.log")
        )

        def start_adapter(log_name: str, **options: str) -> AdapterServer:
            return servers.enter_context(
                AdapterServer(
                    triton.grpc_url,
                    port=0,
                    served_model_name="bench",
                    log_path=tmp / log_name,
                    options={"log_level": "warning", **options},
                    nice=adapter_nice,
                )
            )

        adapter = start_adapter("adapter.log")
        by_triton = (
            start_adapter("adapter-by-triton.log", local_preprocessing="false") if chat else None
        )
        peers = {}
        for mode, batching in (("plain", False), ("continuous-batching", True)) if peer else ():
            server = PeerServer(model, free_port(), batching, tmp / f"peer-{mode}.log")
            peers[mode] = servers.enter_context(server).base_url
        stub = next(stub.process.pid for stub in triton.stubs if stub.model == "llm")
        every = scenarios(
            plan,
            engine,
            triton.grpc_url,
            adapter.url,
            peers,
            model,
            vocab_size,
            chat,
            engine_of(stub).pid,
            by_triton.url if by_triton else None,
        )
        return run_rounds(every, specs, plan)


def median_runs(rounds: Sequence[Sequence[Summary]]) -> list[Summary]:
    """Each scenario's run of median output tok/s over the rounds (the upper one of two)."""
    return [sorted(runs, key=throughput)[len(runs) // 2] for runs in zip(*rounds, strict=True)]


def table(rounds: Sequence[Sequence[Summary]]) -> str:
    """A Markdown table of each scenario's median run, with every round's tok/s; times in ms."""
    head = (
        "| scenario | C | requests | errors | tokens (of planned) | wall s | output tok/s "
        "| tok/s by round | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| others' CPU | engine waiting for a CPU | our CPU ms/token |"
    )
    rows = [head, "|" + "---|" * 16]
    for s, runs in zip(median_runs(rounds), zip(*rounds, strict=True), strict=True):
        by_round = " / ".join(f"{throughput(run):.0f}" for run in runs)
        rows.append(
            f"| {s.target} | {s.concurrency} | {s.requests} | {s.errors} "
            f"| {s.output_tokens} ({s.expected_tokens}) | {s.wall_s:.1f} "
            f"| {s.output_tokens_per_s:.1f} | {by_round} | {s.requests_per_s:.2f} "
            f"| {1e3 * s.ttft_p50:.0f} | {1e3 * s.ttft_p99:.0f} "
            f"| {1e3 * s.tpot_p50:.1f} | {1e3 * s.tpot_p99:.1f} | {100 * s.others_cpu:.0f}% "
            f"| {_percent(s.engine_waiting)} | {_decimal(s.cpu_ms_per_token)} |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class Ratio:
    """A measured ratio against its goal; `noisy` when a run it divides was disturbed. Over
    rounds (`combine`): the median, its range, and noisy when most rounds were."""

    what: str
    value: float
    at_least: bool
    goal: float | None
    """None: no goal of its own (a split of one that has)."""
    noisy: bool
    low: float = float("nan")
    high: float = float("nan")
    rounds: int = 1

    @classmethod
    def of(
        cls,
        what: str,
        num: float,
        den: float,
        at_least: bool,
        goal: float | None,
        *runs: Summary,
    ) -> Ratio:
        return cls(what, num / den, at_least, goal, any(r.others_cpu > NOISY for r in runs))

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        return self.value >= self.goal if self.at_least else self.value <= self.goal

    def line(self) -> str:
        if self.goal is None:
            verdict = "no goal of its own"
        else:
            sign = ">=" if self.at_least else "<="
            verdict = f"goal {sign} {self.goal:g}: {'met' if self.met else 'MISSED'}"
        if self.noisy:
            verdict += "; not conclusive, measured while other processes used the CPUs"
        spread = ""
        if self.rounds > 1:
            spread = f"median of {self.rounds} rounds, {self.low:.2f}-{self.high:.2f}; "
        return f"- {self.what}: **{self.value:.2f}x** ({spread}{verdict})"


def combine(per_round: Sequence[Sequence[Ratio]]) -> list[Ratio]:
    """The same ratios from every round (same order) as their medians."""
    out = []
    for same in zip(*per_round, strict=True):
        values = [ratio.value for ratio in same]
        out.append(
            replace(
                same[0],
                value=statistics.median(values),
                low=min(values),
                high=max(values),
                rounds=len(values),
                noisy=2 * sum(ratio.noisy for ratio in same) > len(same),
            )
        )
    return out


def throughput(summary: Summary) -> float:
    return summary.output_tokens_per_s


def ratios(plan: Plan, summaries: Sequence[Summary]) -> list[Ratio]:
    """The goals of the streaming issue, for whichever scenarios ran."""
    by_name = {(s.target, s.concurrency): s for s in summaries}
    c = plan.reference
    out: list[Ratio] = []
    for concurrency in sorted({1, c}):
        grpc, engine = by_name.get((GRPC, concurrency)), by_name.get((ENGINE, concurrency))
        if grpc and engine:
            what = f"gRPC / engine alone, output tok/s, C={concurrency}"
            out.append(
                Ratio.of(what, throughput(grpc), throughput(engine), True, 0.75, grpc, engine)
            )
    for ours_name, endpoint in ((ADAPTER, "completions"), (ADAPTER_CHAT, "chat")):
        ours = by_name.get((ours_name, c))
        peers = [
            s
            for s in summaries
            if s.target.startswith(PEER) and s.target.endswith(endpoint) and s.concurrency == c
        ]
        if ours is None or not peers:
            continue
        best = max(peers, key=throughput)
        what = f"{ours.target} / {best.target}, C={c}"
        out += [
            Ratio.of(
                f"{what}, output tok/s", throughput(ours), throughput(best), True, 1.5, ours, best
            ),
            Ratio.of(f"{what}, TTFT p50", ours.ttft_p50, best.ttft_p50, False, 1, ours, best),
        ]
    chat, chat_by_triton = by_name.get((ADAPTER_CHAT, c)), by_name.get((ADAPTER_CHAT_BY_TRITON, c))
    if chat and chat_by_triton:
        what = f"chat tokenized in the adapter / by preprocessing, TTFT p50, C={c}"
        runs = (chat, chat_by_triton)
        out.append(Ratio.of(what, chat.ttft_p50, chat_by_triton.ttft_p50, False, None, *runs))
    grpc, adapter = by_name.get((GRPC, c)), by_name.get((ADAPTER, c))
    explicit = by_name.get((GRPC_EXPLICIT, c))
    if adapter and grpc:
        what = f"adapter / gRPC output tok/s, C={c}"
        out.append(Ratio.of(what, throughput(adapter), throughput(grpc), True, 0.9, adapter, grpc))
    if explicit and grpc:
        what = f"{EXPLICIT_ID_COUNT} explicit ids / none, TPOT p50, C={c}"
        out.append(Ratio.of(what, explicit.tpot_p50, grpc.tpot_p50, False, 1.1, explicit, grpc))
        # The same cost as CPU: steadier than TPOT on a VM whose speed swings between runs.
        what = f"{EXPLICIT_ID_COUNT} explicit ids / none, our CPU per token, C={c}"
        cpu = (explicit.cpu_ms_per_token, grpc.cpu_ms_per_token)
        out.append(Ratio.of(what, *cpu, False, None, explicit, grpc))
    sampled = by_name.get((GRPC_LOGPROBS, c))
    if sampled and grpc and explicit:  # the goal above, split: the normaliser, then the ids
        what = f"LOGPROBS=0 / none, TPOT p50, C={c}"
        out.append(Ratio.of(what, sampled.tpot_p50, grpc.tpot_p50, False, None, sampled, grpc))
        what = f"{EXPLICIT_ID_COUNT} explicit ids / LOGPROBS=0, TPOT p50, C={c}"
        runs = (explicit, sampled)
        out.append(Ratio.of(what, explicit.tpot_p50, sampled.tpot_p50, False, None, *runs))
    engine, engine_explicit = by_name.get((ENGINE, c)), by_name.get((ENGINE_EXPLICIT, c))
    if engine and engine_explicit:  # the same goal: what the engine alone leaves of it
        what = f"engine alone: {EXPLICIT_ID_COUNT} explicit ids / none, TPOT p50, C={c}"
        runs = (engine_explicit, engine)
        out.append(Ratio.of(what, engine_explicit.tpot_p50, engine.tpot_p50, False, 1.1, *runs))
    return out


def goal_ratios(plan: Plan, rounds: Sequence[Sequence[Summary]]) -> list[Ratio]:
    """`ratios` within each round, combined. The peer's better mode per endpoint is the one of
    higher median tok/s, the same in every round."""
    best: dict[str, Summary] = {}
    for run in median_runs(rounds):
        endpoint = run.target.rpartition(" ")[2]
        if run.target.startswith(PEER) and (
            endpoint not in best or throughput(run) > throughput(best[endpoint])
        ):
            best[endpoint] = run
    kept = {run.target for run in best.values()}
    return combine(
        [
            ratios(plan, [s for s in runs if not s.target.startswith(PEER) or s.target in kept])
            for runs in rounds
        ]
    )


def report(
    argv: Sequence[str], plan: Plan, rounds: Sequence[Sequence[Summary]], elapsed_s: float
) -> str:
    prompts, outputs = ("/".join(map(str, x)) for x in (PROMPT_LENGTHS, plan.output_lengths))
    lines = [
        f"- Command: `python -m bench.run {shlex.join(argv)}`",
        f"- Machine: {describe_machine()}",
        f"- Load: prompt lengths {prompts} x output lengths {outputs} "
        f"tokens, cycled; greedy; max(2C, {plan.requests}) requests at C>1, "
        f"{plan.serial_requests} at C=1; max_num_seqs {plan.max_num_seqs}; "
        "every server up throughout; each scenario warmed up once, then run once in each of "
        f"{len(rounds)} round(s) (every other round in reverse order; each run after waiting up to "
        f"{plan.quiet_wait_s:.0f} s for others to use under {100 * NOISY:.0f}% of the CPUs). "
        "The table shows each scenario's median run; a ratio is the median of the ratios "
        f'taken within each round. Took {elapsed_s:.0f} s in all. "engine waiting for a CPU": '
        "the share of a served run in which the engine process's threads were runnable but not "
        "running (Linux schedstat, summed over threads). 'our CPU ms/token': the CPU time that "
        "this benchmark's process (the client, and the engine alone) and every process it "
        "started (the servers, idle ones included) used during a run, per output token.",
        "",
        table(rounds),
        "",
        *(r.line() for r in goal_ratios(plan, rounds)),
    ]
    runs = [run for same in rounds for run in same]
    lines += [f"- {s.target}: {s.errors} errors, first: {s.first_error}" for s in runs if s.errors]
    noisy = [f"{s.target} (C={s.concurrency})" for s in runs if s.others_cpu > NOISY]
    if noisy:
        lines.append(
            f"- Noisy runs: other processes used more than {100 * NOISY:.0f}% of the CPUs during "
            f"{', '.join(noisy)}."
        )
    return "\n".join(lines)


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.0f}%"


def _decimal(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _link(path: Path) -> str:
    """The plot's path as RESULTS.md links it."""
    path = path.resolve()
    return (
        str(path.relative_to(RESULTS.parent)) if path.is_relative_to(RESULTS.parent) else str(path)
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    from transformers import AutoConfig, AutoTokenizer  # slow to import: not before --help

    model = (args.model or default_model.ensure()).resolve()
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    plan = make_plan(args)
    specs = {
        c: make_workload(tokenizer, plan.count(c), output_lengths=plan.output_lengths)
        for c in plan.concurrencies
    }
    print(f"model {model} (vocabulary {vocab_size}); {plan}", flush=True)
    chat = not args.no_chat
    try:
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            rounds = run_all(
                model,
                plan,
                specs,
                Path(tmp),
                vocab_size,
                chat,
                not args.no_peer,
                llm_parameters(args),
                args.adapter_nice,
            )
    except KeyboardInterrupt:
        print("interrupted; every server it started has been stopped", file=sys.stderr)
        return 130
    text = report(argv, plan, rounds, time.monotonic() - started)
    if args.plot is not None:
        plot(median_runs(rounds), args.plot)
        text += f"\n\n![output tok/s and p50 TTFT against concurrency]({_link(args.plot)})"
    print("\n" + text)
    if args.results:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with RESULTS.open("a") as out:
            out.write(f"\n### Run of {stamp}\n\n{text}\n")
    return 1 if any(s.errors for same in rounds for s in same) else 0


if __name__ == "__main__":
    sys.exit(main())
