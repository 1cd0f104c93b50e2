"""One prepared GPU check: the kernels and the engine on CUDA, without Triton, in one call.

    PYTHONPATH=. python3 -m bench.gpu_check --out "$OUT"              # on the lent GPU machine
    python -m bench.gpu_check --out /tmp/check --device cpu --quick   # the dry run in the suite

It installs nothing: it runs with the image's python3 and packages (docs/design.md, "The
prepared GPU check"). Stages run in order, each in its own process group with its own time
limit, so a hung CUDA call costs only its stage and a failing stage does not stop the rest:

1. kernel_tests: `pytest tests/kernels` (on CUDA the CUDA-only cases run);
2. kernel_bench: the `bench.kernel_bench` table with the measured copy bandwidth;
3. model: the default model built there (or the test model with `--quick`), with its packages;
4. engine: greedy == `generate`, logprobs vs float64, concurrent == alone (bench/engine_check.py),
   in bf16 and fp32;
5. throughput: the engine alone (a sink that only counts) at 1, 16 and 64 sequences, with the
   device time per decode step; then 16 sequences asking 1024 explicit ids' logprobs each, and
   their TPOT over the 16 without (the explicit-ids goal, docs/design.md, "The prepared GPU
   check").

Each stage prints one summary line; `--out` receives `<stage>.log` (its whole output) and
`results.json` (every stage's status, time and figures), rewritten after each stage. The exit
status is 1 if any stage failed or ran out of time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the stages import their packages in their own processes
    from bench.engine_alone import EngineTarget
    from bench.loadgen import RequestSpec, Summary

REPO = Path(__file__).resolve().parent.parent
THROUGHPUT_CONCURRENCY = (1, 16, 64)
EXPLICIT_ID_CONCURRENCY = 16  # where the explicit-ids goal is set
# B=64, V=128256, bf16 on an H200: the kernel issue's goal.
GOAL_SHAPE = ("bf16", 64, 128256)
GOAL_COPY_FRACTION = 0.8
GOAL_SPEEDUP = 5.0
QUICK_LIMIT_S = 600.0
"""Per stage in the CPU dry run: a slow shared machine must not fail it, a hang still ends."""

Result = dict[str, Any]


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: float
    """On the GPU; they sum to 6 minutes, leaving a rerun inside a 15-minute loan."""
    run: Callable[[argparse.Namespace], Result]
    """In the stage's own process: its figures, with `ok` and a one-line `summary`."""


def _model(args: argparse.Namespace) -> Path:
    from backend import default_model

    spec = default_model.TEST_SPEC if args.quick else default_model.DEFAULT_SPEC
    return default_model.ensure(spec, args.models_dir or default_model.MODELS_DIR)


class _Outcomes:
    """A pytest plugin that counts test outcomes (the call phase, or a setup skip or error)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1


def kernel_tests(args: argparse.Namespace) -> Result:
    import pytest
    import torch

    outcomes = _Outcomes()
    argv = [str(REPO / "tests" / "kernels"), "-q", "-p", "no:cacheprovider"]
    if args.quick:  # the two slow cases that need no GPU: the interpreter rerun, the sm_90 build
        argv += ["-k", "not interpreter and not hopper"]
    exit_code = int(pytest.main(argv, plugins=[outcomes]))
    counts = outcomes.counts
    on = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "exit_code": exit_code,
        **counts,
        "ok": exit_code == 0 and counts.get("passed", 0) > 0,
        "summary": f"pytest tests/kernels on {on}: "
        + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())),
    }


def kernel_bench(args: argparse.Namespace) -> Result:
    from bench.kernel_bench import main as kernel_table

    argv = ["--device", args.device]
    if args.quick:
        argv += ["--batch-sizes", "1", "8", "--vocab-sizes", "32000", "--iters", "3"]
        argv += ["--threads", "1"]
    rows = kernel_table(argv)
    goal: bool | None = None
    goal_row = next((r for r in rows if (r.dtype, r.n_rows, r.n_vocab) == GOAL_SHAPE), None)
    summary = f"{len(rows)} shapes, copy {rows[0].copy_bytes_per_s / 1e9:.0f} GB/s"
    result: Result = {"rows": [asdict(r) for r in rows], "ok": bool(rows)}
    if goal_row is not None:
        fraction, speedup = goal_row.copy_fraction(goal_row.ours_s), goal_row.speedup
        goal = fraction >= GOAL_COPY_FRACTION and speedup >= GOAL_SPEEDUP
        summary += (
            f"; bf16 B=64 V=128256: {100 * fraction:.0f}% of copy, {speedup:.1f}x naive "
            f"(goal >= {100 * GOAL_COPY_FRACTION:.0f}% and >= {GOAL_SPEEDUP:.0f}x: "
            f"{'met' if goal else 'NOT met'})"
        )
    result.update(goal_met=goal, summary=summary)
    return result


def model(args: argparse.Namespace) -> Result:
    """The default model, built here with the machine's packages (it does not travel)."""
    start = time.monotonic()
    path = _model(args)
    seconds = time.monotonic() - start
    return {"path": str(path), "ok": True, "summary": f"{path.name} ready in {seconds:.0f} s"}


def engine(args: argparse.Namespace) -> Result:
    from bench.engine_check import check_engine

    model_dir = _model(args)
    result: Result = {}
    parts = []
    for dtype in ("bfloat16", "float32"):
        checks = check_engine(model_dir, args.device, dtype, args.quick)
        result[dtype] = checks
        ties = checks["concurrent"]["near_tie_divergences"]
        parts.append(
            f"{dtype}: "
            + ", ".join(f"{name} {'ok' if c['ok'] else 'FAILED'}" for name, c in checks.items())
            + (f" ({ties} near-tie divergences)" if ties else "")
        )
    result["ok"] = all(c["ok"] for checks in result.values() for c in checks.values())
    worst = result["float32"].get("logprobs", {})
    if worst:
        parts.append(
            "fp32 worst logprob error "
            f"{max(worst['worst_sampled'], worst['worst_top_k'], worst['worst_explicit']):.1e}"
        )
    result["summary"] = "; ".join(parts)
    return result


class _DecodeTimer:
    """Wraps `runner.decode` to time each call on the device: CUDA events around it (the queued
    kernels' span on the stream, launch gaps included), wall time on CPU."""

    def __init__(self, runner: Any) -> None:
        import torch

        self._cuda = runner.device.type == "cuda"
        self._event = torch.cuda.Event
        self._decode = runner.decode
        self._marks: list[Any] = []
        runner.decode = self

    def __call__(
        self,
        tokens: list[int],
        positions: list[int],
        before_lm_head: Callable[[], None] | None = None,
    ) -> Any:
        if not self._cuda:
            began = time.perf_counter()
            logits = self._decode(tokens, positions, before_lm_head)
            self._marks.append(time.perf_counter() - began)
            return logits
        start, end = self._event(enable_timing=True), self._event(enable_timing=True)
        start.record()
        logits = self._decode(tokens, positions, before_lm_head)
        end.record()
        self._marks.append((start, end))
        return logits

    def take_ms(self) -> list[float]:
        """Each call's milliseconds since the last take (synchronises on CUDA)."""
        marks, self._marks = self._marks, []
        if not self._cuda:
            return [1e3 * s for s in marks]
        for _, end in marks:
            end.synchronize()
        return [start.elapsed_time(end) for start, end in marks]


def _load(
    target: EngineTarget, timer: _DecodeTimer, specs: list[RequestSpec], concurrency: int
) -> tuple[Summary, float]:
    """`specs` at `concurrency` sequences: the load's summary and the median decode step in ms;
    an error or a missing token fails the stage."""
    from bench.loadgen import Summary, run_load

    summary = Summary.from_load(asyncio.run(run_load(target, specs, concurrency)))
    if summary.errors or summary.output_tokens != summary.expected_tokens:
        raise RuntimeError(f"C={concurrency}: {summary.first_error or 'tokens missing'}")
    return summary, statistics.median(timer.take_ms())


def throughput(args: argparse.Namespace) -> Result:
    from bench.engine_alone import EngineTarget
    from bench.loadgen import explicit_ids, make_workload, run_load
    from tests.reference import tokenizer

    model_dir = _model(args)
    tok = tokenizer(model_dir)
    lengths: dict[str, Any] = (
        {"prompt_lengths": (8, 16), "output_lengths": (4, 8)} if args.quick else {}
    )
    target = EngineTarget(model_dir, max(THROUGHPUT_CONCURRENCY), device=args.device)
    timer = _DecodeTimer(target.runner)
    result: Result = {"dtype": str(target.runner.dtype)}
    parts = []
    try:
        asyncio.run(run_load(target, make_workload(tok, 4, **lengths), 4))  # warm-up
        timer.take_ms()
        for concurrency in THROUGHPUT_CONCURRENCY:
            specs = make_workload(tok, 2 * concurrency, **lengths)
            summary, step_ms = _load(target, timer, specs, concurrency)
            result[f"C={concurrency}"] = {**asdict(summary), "decode_step_ms": step_ms}
            parts.append(
                f"C={concurrency}: {summary.output_tokens_per_s:.0f} tok/s, "
                f"decode step {step_ms:.2f} ms"
            )
        concurrency = EXPLICIT_ID_CONCURRENCY
        ids = explicit_ids(target.runner.vocab_size)
        target.logprob_token_ids = ids
        specs = make_workload(tok, 2 * concurrency, **lengths)
        summary, step_ms = _load(target, timer, specs, concurrency)
        name = f"C={concurrency} + {len(ids)} ids"
        result[name] = {**asdict(summary), "decode_step_ms": step_ms}
        ratio = summary.tpot_p50 / result[f"C={concurrency}"]["tpot_p50"]
        result["explicit_ids_tpot_ratio"] = ratio
        parts.append(f"{name}: {ratio:.2f}x TPOT")
    finally:
        target.stop()
    clock = "CUDA events" if target.runner.device.type == "cuda" else "wall"
    result.update(ok=True, summary="; ".join(parts) + f" ({result['dtype']}, {clock})")
    return result


STAGES = [
    Stage("kernel_tests", 100, kernel_tests),
    Stage("kernel_bench", 60, kernel_bench),
    Stage("model", 75, model),
    Stage("engine", 75, engine),
    Stage("throughput", 50, throughput),
]


EXIT_WAIT_S = 30.0
"""How long a killed stage is waited for: one stuck in the GPU driver may never exit, and the
stages after it still run."""


def run_stage(name: str, command: list[str], limit_s: float, out: Path) -> Result:
    """`command` with its output in `out/<name>.log`, killed with its process group at
    `limit_s`; its result is what it wrote to the file named by its `--result` argument."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            child = subprocess.Popen(
                [*command, "--result", str(result_path)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                exit_code: int | None = child.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                exit_code = None
                try:
                    child.wait(timeout=EXIT_WAIT_S)
                    stuck = ""
                except subprocess.TimeoutExpired:
                    stuck = f"; still running {EXIT_WAIT_S:.0f} s later (pid {child.pid})"
        seconds = time.monotonic() - start
        result: Result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if exit_code is None:
        status, summary = "timeout", f"killed after {limit_s:.0f} s{stuck}"
    elif exit_code != 0 or not result.get("ok"):
        status = "failed"
        summary = result.get("summary") or f"exit {exit_code}: see {name}.log"
    else:
        status, summary = "ok", result["summary"]
    return {**result, "status": status, "seconds": round(seconds, 1), "summary": summary}


def _run_one(args: argparse.Namespace) -> int:
    """In a stage's process: run it, write its result (an exception's text on failure) and the
    versions it ran with, since the image's differ from the pins."""
    stage = next(s for s in STAGES if s.name == args.stage)
    versions: dict[str, str] = {}
    try:
        for name in ("numpy", "torch", "triton", "transformers"):
            versions[name] = importlib.import_module(name).__version__
        result = stage.run(args)
    except Exception as exc:
        failure = {"ok": False, "summary": f"{type(exc).__name__}: {exc}", "versions": versions}
        Path(args.result).write_text(json.dumps(failure))
        raise
    Path(args.result).write_text(json.dumps({**result, "versions": versions}, default=str))
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--out", type=Path, help="folder for the logs and results.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and the test model")
    parser.add_argument("--stages", nargs="+", choices=[s.name for s in STAGES])
    parser.add_argument("--models-dir", type=Path, help="where the model is built (.cache/models)")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        return _run_one(args)
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Result] = {}
    for stage in STAGES:
        if args.stages and stage.name not in args.stages:
            continue
        command = [sys.executable, "-m", "bench.gpu_check", "--stage", stage.name]
        command += ["--device", args.device] + (["--quick"] if args.quick else [])
        command += ["--models-dir", str(args.models_dir)] if args.models_dir else []
        limit_s = QUICK_LIMIT_S if args.quick else stage.limit_s
        result = run_stage(stage.name, command, limit_s, args.out)
        results[stage.name] = result
        print(f"{stage.name} [{result['status']}, {result['seconds']:.0f} s]: {result['summary']}")
        sys.stdout.flush()
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
