"""The engine with no server around it: what serving it over Triton is measured against.

`EngineTarget` runs `backend.engine.Engine` in this process, with the thread count the `llm`
model uses, and a sink that only counts tokens and notes the first one. It speaks the
load generator's `Target` protocol, so its row comes from the same workload and timing code as
the served ones.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from backend.config import LLMConfig
from backend.engine_process import build_engine
from backend.outputs import StepOutput
from backend.params import GenerationParams
from backend.structured_output import StructuredOutput
from bench.environment import OthersCpu
from bench.loadgen import FirstToken, RequestSpec, Summary, make_workload, run_load


class _CountingSink:
    """Counts a request's tokens (engine thread) and resolves `done` on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, first_token: FirstToken) -> None:
        self._loop = loop
        self._first_token = first_token
        self.tokens = 0
        self.done: asyncio.Future[int] = loop.create_future()

    def send(self, output: StepOutput) -> None:
        if output.token_ids and not self.tokens:
            self._loop.call_soon_threadsafe(self._first_token)
        self.tokens += len(output.token_ids)
        if output.finish_reason is not None:
            self._loop.call_soon_threadsafe(self._resolve, self.tokens, None)

    def send_error(self, message: str, *, kind: str = "") -> None:
        self._loop.call_soon_threadsafe(self._resolve, 0, RuntimeError(message))

    def is_cancelled(self) -> bool:
        return False

    def _resolve(self, tokens: int, error: Exception | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(tokens)
        else:
            self.done.set_exception(error)


class EngineTarget:
    """Greedy, `IGNORE_EOS`, token-id prompts: the same requests `TritonTarget` sends, each with
    `structured_output` (bench.structured_bench) and `logprob_token_ids` when set."""

    def __init__(
        self,
        model: Path,
        max_num_seqs: int,
        name: str = "engine alone",
        fast_decode: bool = True,
        device: str = "cpu",
        dtype: str = "auto",
    ) -> None:
        self.name = name
        # The served engine's construction: `llm`'s config with its defaults (num_threads 0).
        self._engine = build_engine(
            LLMConfig(
                model_path=str(model),
                device=device,
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                fast_decode=fast_decode,
            ),
            on_stats=None,
        )
        self.runner = self._engine.runner
        self._engine.start()
        self.structured_output: StructuredOutput | None = None
        self.logprob_token_ids: list[int] = []

    async def generate(self, spec: RequestSpec, first_token: FirstToken) -> int:
        sink = _CountingSink(asyncio.get_running_loop(), first_token)
        params = GenerationParams(
            prompt_ids=list(spec.prompt_ids),
            max_tokens=spec.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            structured_output=self.structured_output,
            logprob_token_ids=self.logprob_token_ids,
        )
        self._engine.submit(params, sink)
        return await sink.done

    async def aclose(self) -> None:
        """The engine outlives one measurement: `stop` ends it."""

    def stop(self) -> None:
        self._engine.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.engine_alone`: the engine alone with and without `fast_decode`,
    alternating rounds in one process, so the two are measured side by side."""
    parser = argparse.ArgumentParser(prog="python -m bench.engine_alone", description=main.__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from backend import default_model

    model = default_model.ensure().resolve()
    tokenizer = AutoTokenizer.from_pretrained(model)
    for concurrency in args.concurrency:
        specs = make_workload(tokenizer, max(54, 2 * concurrency) if concurrency > 1 else 9)
        targets = {
            fast: EngineTarget(model, max(args.concurrency), fast_decode=fast)
            for fast in (False, True)
        }
        best: dict[bool, float] = {}
        others = 0.0
        try:
            for _ in range(args.rounds):
                for fast, target in targets.items():
                    with OthersCpu() as cpu:
                        load = asyncio.run(run_load(target, specs, concurrency))
                    others = max(others, cpu.share)
                    rate = Summary.from_load(load).output_tokens_per_s
                    best[fast] = max(best.get(fast, 0.0), rate)
        finally:
            for target in targets.values():
                target.stop()
        print(
            f"C={concurrency}: transformers decode {best[False]:.0f} tok/s, fast_decode "
            f"{best[True]:.0f} tok/s ({best[True] / best[False]:.2f}x; best of {args.rounds}; "
            f"others used at most {100 * others:.0f}% of the CPUs)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
