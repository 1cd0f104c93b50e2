"""`python -m bench.run`: our stack and `transformers serve` under the same load, side by side.

Starts everything it measures on free loopback ports and stops it again (also on Ctrl-C,
SIGTERM and errors), one at a time so no idle server shares the CPU with the one measured: the
engine alone in this process, tritonserver with the `llm` model (gRPC), the OpenAI adapter in
front of it (completions and chat), then `transformers serve` on the same model folder in its
plain mode and with `--continuous-batching` (completions and chat). Each runs at every
concurrency of the sweep on the same fixed mix of prompt and output lengths, after a short
warm-up. Prints one table and the ratios against the goals; `--results` appends them to
bench/RESULTS.md and `--plot` draws tok/s and p50 TTFT against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from backend import default_model
from backend.adapter_server import AdapterServer
from backend.processes import ChildProcess, free_port
from backend.repository import write_repository
from backend.tritonserver import TritonServer
from bench.engine_alone import EngineTarget
from bench.environment import OthersCpu, describe_machine, wait_until_quiet
from bench.loadgen import (
    OUTPUT_LENGTHS,
    PROMPT_LENGTHS,
    OpenAITarget,
    RequestSpec,
    Summary,
    Target,
    TritonTarget,
    make_workload,
    run_load,
)
from bench.plot import plot

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
REPO_ROOT = Path(__file__).resolve().parent.parent
EXPLICIT_IDS = 1024
ENGINE = "ours: engine alone"
ENGINE_EXPLICIT = f"ours: engine alone + {EXPLICIT_IDS} ids"
GRPC = "ours: Triton gRPC (llm)"
GRPC_EXPLICIT = f"ours: Triton gRPC + {EXPLICIT_IDS} ids"
ADAPTER = "ours: adapter completions"
ADAPTER_CHAT = "ours: adapter chat"
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
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"

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
    attempts: int

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
        "--attempts",
        type=int,
        default=2,
        help="measured runs per scenario at most; the first quiet one is kept",
    )
    parser.add_argument(
        "--llm-parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an `llm` config.pbtxt parameter for our stack (docs/configuration.md); repeatable",
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
        max(args.attempts, 1),
    )


async def measure(
    target: Target, specs: Sequence[RequestSpec], concurrency: int, plan: Plan
) -> Summary:
    """A warm-up of `concurrency` short requests, then up to `plan.attempts` measured runs, each
    after a bounded wait for a quiet machine; the first quiet run (else the least disturbed one)
    is kept. Closes the target."""
    try:
        warmup = [replace(s, max_tokens=WARMUP_TOKENS) for s in specs[:concurrency]]
        failed = [
            r.error for r in (await run_load(target, warmup, concurrency)).requests if r.error
        ]
        if failed:
            raise RuntimeError(f"{target.name}: the warm-up failed: {failed[0]}")
        runs: list[Summary] = []
        for _ in range(plan.attempts):
            if plan.quiet_wait_s > 0:
                await asyncio.to_thread(wait_until_quiet, plan.quiet_wait_s, NOISY)
            with OthersCpu() as others:
                load = await run_load(target, specs, concurrency)
            runs.append(replace(Summary.from_load(load), others_cpu=others.share))
            print(
                f"  {target.name:<40} C={concurrency:<3} {runs[-1].output_tokens_per_s:7.1f} "
                f"tok/s, others used {100 * others.share:.0f}% of the CPUs",
                flush=True,
            )
            if others.share <= NOISY:
                break
    finally:
        await target.aclose()
    return min(runs, key=lambda run: run.others_cpu)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def explicit_ids(vocab_size: int, count: int = EXPLICIT_IDS) -> list[int]:
    """`count` distinct ids spread over the whole vocabulary."""
    step = max(vocab_size // count, 1)
    return list(range(0, step * count, step))[:count]


def run_engine_alone(
    model: Path, plan: Plan, specs: dict[int, list[RequestSpec]], vocab_size: int
) -> list[Summary]:
    """The same requests straight into `backend.engine.Engine`, in this process; then with the
    explicit ids at the reference concurrency, to tell the engine's share of their cost."""
    target = EngineTarget(model, plan.max_num_seqs, name=ENGINE)
    try:
        summaries = [asyncio.run(measure(target, specs[c], c, plan)) for c in plan.concurrencies]
        target.name, target.logprob_token_ids = ENGINE_EXPLICIT, explicit_ids(vocab_size)
        c = plan.reference
        return [*summaries, asyncio.run(measure(target, specs[c], c, plan))]
    finally:
        target.stop()


def adapter_target(base_url: str, chat: bool, concurrency: int) -> OpenAITarget:
    return OpenAITarget(
        base_url,
        "bench",
        ADAPTER_CHAT if chat else ADAPTER,
        chat=chat,
        token_ids=True,
        extra={"ignore_eos": True, "stream_options": {"include_usage": True}},
        concurrency=concurrency,
    )


def run_ours(
    model: Path,
    plan: Plan,
    specs: dict[int, list[RequestSpec]],
    tmp: Path,
    vocab_size: int,
    chat: bool,
    llm_parameters: Mapping[str, str],
) -> list[Summary]:
    """gRPC at every concurrency, the explicit ids at the reference one, then the adapter."""
    repository = write_repository(
        tmp / "model_repository",
        model,
        {"max_num_seqs": str(plan.max_num_seqs), **llm_parameters},
    )
    server = TritonServer(
        repository, http_port=0, grpc_port=0, metrics_port=0, log_path=tmp / "tritonserver.log"
    )
    summaries = []
    c = plan.reference
    with server:
        for concurrency in plan.concurrencies:
            target: Target = TritonTarget(server.grpc_url, name=GRPC)
            summaries.append(asyncio.run(measure(target, specs[concurrency], concurrency, plan)))
        ids = explicit_ids(vocab_size)
        target = TritonTarget(server.grpc_url, logprob_token_ids=ids, name=GRPC_EXPLICIT)
        summaries.append(asyncio.run(measure(target, specs[c], c, plan)))
        adapter = AdapterServer(
            server.grpc_url,
            port=0,
            served_model_name="bench",
            log_path=tmp / "adapter.log",
            options={"log_level": "warning"},
        )
        with adapter:
            for endpoint_is_chat in (False, True) if chat else (False,):
                for concurrency in plan.concurrencies:
                    target = adapter_target(adapter.url, endpoint_is_chat, concurrency)
                    summaries.append(
                        asyncio.run(measure(target, specs[concurrency], concurrency, plan))
                    )
    return summaries


def run_peer(
    model: Path, plan: Plan, specs: dict[int, list[RequestSpec]], tmp: Path, chat: bool
) -> list[Summary]:
    """`transformers serve` in both modes, text prompts, usage counted (it has no ignore_eos)."""
    summaries = []
    for continuous_batching in (False, True):
        mode = "continuous-batching" if continuous_batching else "plain"
        peer = PeerServer(model, free_port(), continuous_batching, tmp / f"peer-{mode}.log")
        with peer:
            for endpoint_is_chat in (False, True) if chat else (False,):
                endpoint = "chat" if endpoint_is_chat else "completions"
                for concurrency in plan.concurrencies:
                    target = OpenAITarget(
                        f"http://127.0.0.1:{peer.port}",
                        str(model),
                        f"{PEER} ({mode}) {endpoint}",
                        chat=endpoint_is_chat,
                        concurrency=concurrency,
                    )
                    summaries.append(
                        asyncio.run(measure(target, specs[concurrency], concurrency, plan))
                    )
    return summaries


def table(summaries: Sequence[Summary]) -> str:
    """A Markdown table; times in milliseconds."""
    head = (
        "| scenario | C | requests | errors | tokens (of planned) | wall s | output tok/s | req/s "
        "| TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | others' CPU |"
    )
    rows = [head, "|" + "---|" * 13]
    for s in summaries:
        rows.append(
            f"| {s.target} | {s.concurrency} | {s.requests} | {s.errors} "
            f"| {s.output_tokens} ({s.expected_tokens}) | {s.wall_s:.1f} "
            f"| {s.output_tokens_per_s:.1f} | {s.requests_per_s:.2f} "
            f"| {1e3 * s.ttft_p50:.0f} | {1e3 * s.ttft_p99:.0f} "
            f"| {1e3 * s.tpot_p50:.1f} | {1e3 * s.tpot_p99:.1f} | {100 * s.others_cpu:.0f}% |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class Ratio:
    """A measured ratio against its goal; `noisy` when a run it divides was disturbed."""

    what: str
    value: float
    at_least: bool
    goal: float
    noisy: bool

    @classmethod
    def of(
        cls, what: str, num: float, den: float, at_least: bool, goal: float, *runs: Summary
    ) -> Ratio:
        return cls(what, num / den, at_least, goal, any(r.others_cpu > NOISY for r in runs))

    @property
    def met(self) -> bool:
        return self.value >= self.goal if self.at_least else self.value <= self.goal

    def line(self) -> str:
        verdict = "met" if self.met else "MISSED"
        if self.noisy:
            verdict += "; not conclusive, measured while other processes used the CPUs"
        goal = f"{'>=' if self.at_least else '<='} {self.goal:g}"
        return f"- {self.what}: **{self.value:.2f}x** (goal {goal}: {verdict})"


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
    grpc, adapter = by_name.get((GRPC, c)), by_name.get((ADAPTER, c))
    explicit = by_name.get((GRPC_EXPLICIT, c))
    if adapter and grpc:
        what = f"adapter / gRPC output tok/s, C={c}"
        out.append(Ratio.of(what, throughput(adapter), throughput(grpc), True, 0.9, adapter, grpc))
    if explicit and grpc:
        what = f"{EXPLICIT_IDS} explicit ids / none, TPOT p50, C={c}"
        out.append(Ratio.of(what, explicit.tpot_p50, grpc.tpot_p50, False, 1.1, explicit, grpc))
    engine, engine_explicit = by_name.get((ENGINE, c)), by_name.get((ENGINE_EXPLICIT, c))
    if engine and engine_explicit:  # the same goal: what the engine alone leaves of it
        what = f"engine alone: {EXPLICIT_IDS} explicit ids / none, TPOT p50, C={c}"
        runs = (engine_explicit, engine)
        out.append(Ratio.of(what, engine_explicit.tpot_p50, engine.tpot_p50, False, 1.1, *runs))
    return out


def report(argv: Sequence[str], plan: Plan, summaries: Sequence[Summary], elapsed_s: float) -> str:
    prompts, outputs = ("/".join(map(str, x)) for x in (PROMPT_LENGTHS, plan.output_lengths))
    lines = [
        f"- Command: `python -m bench.run {shlex.join(argv)}`",
        f"- Machine: {describe_machine()}",
        f"- Load: prompt lengths {prompts} x output lengths {outputs} "
        f"tokens, cycled; greedy; max(2C, {plan.requests}) requests at C>1, "
        f"{plan.serial_requests} at C=1; max_num_seqs {plan.max_num_seqs}; "
        f"each scenario warmed up, then measured up to {plan.attempts} times (each after waiting "
        f"up to {plan.quiet_wait_s:.0f} s for a quiet machine), keeping the first run in which "
        f"others used <= {100 * NOISY:.0f}% of the CPUs, else the least disturbed; "
        f"took {elapsed_s:.0f} s in all.",
        "",
        table(summaries),
        "",
        *(r.line() for r in ratios(plan, summaries)),
    ]
    errors = [s for s in summaries if s.first_error]
    lines += [f"- {s.target}: {s.errors} errors, first: {s.first_error}" for s in errors]
    noisy = [f"{s.target} (C={s.concurrency})" for s in summaries if s.others_cpu > NOISY]
    if noisy:
        lines.append(
            f"- Noisy: other processes used more than {100 * NOISY:.0f}% of the CPUs during "
            f"{', '.join(noisy)}; rerun those numbers on a quiet machine."
        )
    return "\n".join(lines)


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
            summaries = run_engine_alone(model, plan, specs, vocab_size)
            summaries += run_ours(
                model, plan, specs, Path(tmp), vocab_size, chat, llm_parameters(args)
            )
            if not args.no_peer:
                summaries += run_peer(model, plan, specs, Path(tmp), chat)
    except KeyboardInterrupt:
        print("interrupted; every server it started has been stopped", file=sys.stderr)
        return 130
    text = report(argv, plan, summaries, time.monotonic() - started)
    if args.plot is not None:
        plot(summaries, args.plot)
        text += f"\n\n![output tok/s and p50 TTFT against concurrency]({_link(args.plot)})"
    print("\n" + text)
    if args.results:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with RESULTS.open("a") as out:
            out.write(f"\n### Run of {stamp}\n\n{text}\n")
    return 1 if any(s.errors for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
