"""`python -m bench.structured_bench`: what structured outputs cost the engine (no server).

- TPOT at concurrency 16 with every row constrained by a 20-field JSON schema against none, in
  alternating rounds on one engine (the schema's strings have a minimum length, so no row ends
  before its `max_tokens`: both batches stay full);
- the compile time of that schema (cold: a new schema each time);
- the first-token latency of one request whose grammar is cold against one whose grammar is
  cached.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from backend import default_model
from backend.structured_output import StructuredOutput
from bench.engine_alone import EngineTarget
from bench.environment import OthersCpu
from bench.loadgen import RequestSpec, Summary, make_workload, run_load

FIELDS = 20


def schema(title: str) -> StructuredOutput:
    """An object of `FIELDS` required strings of 30-40 characters; `title` makes it a new spec
    (a cache miss) without changing the grammar's size."""
    fields = {
        f"field_{i:02d}": {"type": "string", "minLength": 30, "maxLength": 40}
        for i in range(FIELDS)
    }
    body = {
        "title": title,
        "type": "object",
        "properties": fields,
        "required": list(fields),
        "additionalProperties": False,
    }
    return StructuredOutput.json_schema(body, disable_any_whitespace=True)


def _tpot(
    target: EngineTarget, specs: list[RequestSpec], rounds: int
) -> tuple[dict[str, list[float]], float]:
    tpot: dict[str, list[float]] = {"none": [], "json schema": []}
    others = 0.0
    spec = schema("tpot")
    for _ in range(rounds):
        for mode in tpot:
            target.structured_output = spec if mode == "json schema" else None
            with OthersCpu() as cpu:
                load = asyncio.run(run_load(target, specs, 16))
            others = max(others, cpu.share)
            summary = Summary.from_load(load)
            if summary.errors:
                raise RuntimeError(f"{mode}: {summary.first_error}")
            tpot[mode].append(summary.tpot_p50)
    target.structured_output = None
    return tpot, others


def _first_token_s(target: EngineTarget, spec: RequestSpec, structured: StructuredOutput) -> float:
    target.structured_output = structured
    load = asyncio.run(run_load(target, [spec], 1))
    request = load.requests[0]
    if request.error is not None or request.first_token is None:
        raise RuntimeError(f"no first token: {request.error}")
    return request.first_token - request.start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured_bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=5, help="cold / cached first tokens")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model = default_model.ensure().resolve()
    tokenizer = AutoTokenizer.from_pretrained(model)
    specs = [
        RequestSpec(s.prompt_ids, s.prompt_text, args.max_tokens)
        for s in make_workload(tokenizer, 48)
    ]
    target = EngineTarget(model, 16)
    try:
        asyncio.run(run_load(target, specs[:16], 16))  # warm-up
        tpot, others = _tpot(target, specs, args.rounds)
        compiler = target._engine._grammar_compiler()
        compile_s = []
        for i in range(args.samples):
            started = time.perf_counter()
            compiler.compile(schema(f"compile {i}")).result()
            compile_s.append(time.perf_counter() - started)
        cold, cached = [], []
        for i in range(args.samples):
            structured = schema(f"first token {i}")
            cold.append(_first_token_s(target, specs[i], structured))
            cached.append(_first_token_s(target, specs[i], structured))
    finally:
        target.stop()
    none, constrained = statistics.median(tpot["none"]), statistics.median(tpot["json schema"])
    ms = [f"{1e3 * t:.2f}" for t in tpot["none"]], [f"{1e3 * t:.2f}" for t in tpot["json schema"]]
    print(f"- Command: `python -m bench.structured_bench {' '.join(argv or sys.argv[1:])}`")
    print(
        f"- TPOT p50 at C=16 ({len(specs)} requests of {args.max_tokens} tokens, {args.rounds} "
        f"alternating rounds): none {', '.join(ms[0])} ms; every row a {FIELDS}-field JSON schema "
        f"{', '.join(ms[1])} ms; median ratio **{constrained / none:.2f}x** (goal <= 1.3); "
        f"others used at most {100 * others:.0f}% of the CPUs"
    )
    print(
        f"- Compile of the {FIELDS}-field schema (cold, {args.samples} schemas): median "
        f"{1e3 * statistics.median(compile_s):.1f} ms (min {1e3 * min(compile_s):.1f}, max "
        f"{1e3 * max(compile_s):.1f})"
    )
    print(
        f"- First token at C=1, median of {args.samples}: cold grammar "
        f"{1e3 * statistics.median(cold):.1f} ms, cached {1e3 * statistics.median(cached):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
