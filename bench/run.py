"""`python -m bench.run`: our stack and `transformers serve` under the same load, side by side.

Starts everything it measures on free loopback ports and stops it again (also on Ctrl-C,
SIGTERM and errors): tritonserver with the `llm` model, the OpenAI adapter in front of it, then
`transformers serve` on the same model folder in its plain mode and with
`--continuous-batching`, one at a time so no idle server shares the CPU with the one measured.
Every scenario gets the same fixed mix of prompt and output lengths, after a short warm-up.
Prints one table and the ratios against the goals; `--results` appends them to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType, TracebackType

import httpx

from backend import default_model
from backend.repository import write_repository
from backend.tritonserver import TritonServer, free_port
from bench.environment import OthersCpu, describe_machine, wait_until_quiet
from bench.loadgen import (
    OUTPUT_LENGTHS,
    PROMPT_LENGTHS,
    OpenAICompletionsTarget,
    RequestSpec,
    Summary,
    Target,
    TritonTarget,
    make_workload,
    run_load,
)

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
REPO_ROOT = Path(__file__).resolve().parent.parent
EXPLICIT_IDS = 1024
GRPC = "ours: Triton gRPC (llm)"
GRPC_EXPLICIT = f"ours: Triton gRPC + {EXPLICIT_IDS} ids"
ADAPTER = "ours: adapter (OpenAI SSE)"
PEER = "transformers serve"
WARMUP_TOKENS = 8
NOISY = 0.1  # others' CPU share above which a run is flagged


@dataclass
class ServerProcess:
    """A server child process in its own session; a context manager that waits until `health_url`
    answers 200 and on exit stops the whole process group (SIGINT, then SIGKILL)."""

    command: list[str]
    health_url: str
    log_path: Path
    ready_timeout_s: float = 180.0
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.health_url, timeout=2, trust_env=False).status_code == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{self.health_url} not ready in {self.ready_timeout_s:.0f} s")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # uvicorn's graceful shutdown
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):  # whatever it forked and left behind
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@dataclass(frozen=True)
class Plan:
    """How many requests at which concurrency; the largest concurrency is the 'load' one."""

    concurrencies: tuple[int, ...]
    requests: int
    serial_requests: int
    output_lengths: tuple[int, ...]
    quiet_wait_s: float
    attempts: int

    @property
    def load(self) -> int:
        return max(self.concurrencies)

    def count(self, concurrency: int) -> int:
        return self.serial_requests if concurrency == 1 else self.requests


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
        default=[1, 16],
        help="concurrencies of the gRPC runs; the largest is used for every other scenario",
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
    parser.add_argument("--no-peer", action="store_true", help="skip the `transformers serve` runs")
    parser.add_argument(
        "--results",
        action="store_true",
        help=f"append a section to {RESULTS.relative_to(REPO_ROOT)}",
    )
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    concurrencies = tuple(sorted(set(args.concurrency)))
    if args.quick:
        return Plan(concurrencies, 16, 3, (4, 8, 16), 0.0, 1)
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


def adapter_command(port: int, triton_url: str) -> list[str]:
    command = [
        sys.executable, "-m", "adapter",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--triton-url", triton_url,
        "--served-model-name", "bench",
        "--log-level", "warning",
    ]  # fmt: skip
    return command


def peer_command(model: Path, port: int, continuous_batching: bool) -> list[str]:
    command = [
        str(Path(sys.executable).parent / "transformers"), "serve", str(model),
        "--device", "cpu",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    return [*command, "--continuous-batching"] if continuous_batching else command


def run_ours(
    model: Path, plan: Plan, specs: dict[int, list[RequestSpec]], tmp: Path, vocab_size: int
) -> list[Summary]:
    """gRPC at every concurrency, the explicit ids and the adapter at the load concurrency."""
    repository = write_repository(tmp / "model_repository", model, {"max_num_seqs": str(plan.load)})
    server = TritonServer(
        repository, http_port=0, grpc_port=0, metrics_port=0, log_path=tmp / "tritonserver.log"
    )
    summaries = []
    c, load_specs = plan.load, specs[plan.load]
    with server:
        for concurrency in plan.concurrencies:
            target = TritonTarget(server.grpc_url, name=GRPC)
            summaries.append(asyncio.run(measure(target, specs[concurrency], concurrency, plan)))
        ids = explicit_ids(vocab_size)
        target = TritonTarget(server.grpc_url, logprob_token_ids=ids, name=GRPC_EXPLICIT)
        summaries.append(asyncio.run(measure(target, load_specs, c, plan)))
        port = free_port()
        health = f"http://127.0.0.1:{port}/health/ready"
        with ServerProcess(adapter_command(port, server.grpc_url), health, tmp / "adapter.log"):
            target = OpenAICompletionsTarget(
                f"http://127.0.0.1:{port}",
                "bench",
                ADAPTER,
                token_ids=True,
                extra={"ignore_eos": True, "stream_options": {"include_usage": True}},
                concurrency=c,
            )
            summaries.append(asyncio.run(measure(target, load_specs, c, plan)))
    return summaries


def run_peer(model: Path, plan: Plan, specs: list[RequestSpec], tmp: Path) -> list[Summary]:
    """`transformers serve` in both modes, text prompts, usage counted (it has no ignore_eos)."""
    summaries = []
    for continuous_batching in (False, True):
        mode = "continuous-batching" if continuous_batching else "plain"
        port = free_port()
        command = peer_command(model, port, continuous_batching)
        with ServerProcess(command, f"http://127.0.0.1:{port}/health", tmp / f"peer-{mode}.log"):
            target = OpenAICompletionsTarget(
                f"http://127.0.0.1:{port}",
                str(model),
                f"{PEER} ({mode})",
                token_ids=False,
                concurrency=plan.load,
            )
            summaries.append(asyncio.run(measure(target, specs, plan.load, plan)))
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
    """The goals of the issue, for whichever scenarios ran."""
    by_name = {(s.target, s.concurrency): s for s in summaries}
    c = plan.load
    grpc, serial = by_name.get((GRPC, c)), by_name.get((GRPC, 1))
    adapter, explicit = by_name.get((ADAPTER, c)), by_name.get((GRPC_EXPLICIT, c))
    peers = [s for s in summaries if s.target.startswith(PEER)]
    out: list[Ratio] = []
    if grpc and serial:
        what = f"gRPC output tok/s, C={c} / C=1"
        out.append(Ratio.of(what, throughput(grpc), throughput(serial), True, 8, grpc, serial))
    if peers:
        best = max(peers, key=throughput)
        for ours in (s for s in (adapter, grpc) if s is not None):
            what = f"{ours.target} / {best.target}"
            out += [
                Ratio.of(
                    f"{what}, output tok/s",
                    throughput(ours),
                    throughput(best),
                    True,
                    1.5,
                    ours,
                    best,
                ),
                Ratio.of(f"{what}, TTFT p50", ours.ttft_p50, best.ttft_p50, False, 1, ours, best),
            ]
    if adapter and grpc:
        what = f"adapter / gRPC output tok/s, C={c}"
        out.append(Ratio.of(what, throughput(adapter), throughput(grpc), True, 0.9, adapter, grpc))
    if explicit and grpc:
        what = f"{EXPLICIT_IDS} explicit ids / none, TPOT p50, C={c}"
        out.append(Ratio.of(what, explicit.tpot_p50, grpc.tpot_p50, False, 1.1, explicit, grpc))
    return out


def report(argv: Sequence[str], plan: Plan, summaries: Sequence[Summary], elapsed_s: float) -> str:
    prompts, outputs = ("/".join(map(str, x)) for x in (PROMPT_LENGTHS, plan.output_lengths))
    lines = [
        f"- Command: `python -m bench.run {shlex.join(argv)}`",
        f"- Machine: {describe_machine()}",
        f"- Load: prompt lengths {prompts} x output lengths {outputs} "
        f"tokens, cycled; greedy; {plan.requests} requests at C>1, {plan.serial_requests} at C=1; "
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
    try:
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            summaries = run_ours(model, plan, specs, Path(tmp), vocab_size)
            if not args.no_peer:
                summaries += run_peer(model, plan, specs[plan.load], Path(tmp))
    except KeyboardInterrupt:
        print("interrupted; every server it started has been stopped", file=sys.stderr)
        return 130
    text = report(argv, plan, summaries, time.monotonic() - started)
    print("\n" + text)
    if args.results:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with RESULTS.open("a") as out:
            out.write(f"\n### Run of {stamp}\n\n{text}\n")
    return 1 if any(s.errors for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
