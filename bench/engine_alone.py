"""The engine with no server around it: what serving it over Triton is measured against.

`EngineTarget` runs `backend.engine.Engine` in this process, with the thread count the `llm`
model uses, and a sink that only counts tokens and notes the first one. It speaks the
load generator's `Target` protocol, so its row comes from the same workload and timing code as
the served ones.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch

from backend.engine import Engine
from backend.model_runner import ModelRunner
from backend.outputs import StepOutput
from backend.params import GenerationParams
from bench.loadgen import FirstToken, RequestSpec


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
    """Greedy, `IGNORE_EOS`, token-id prompts: the same requests `TritonTarget` sends."""

    def __init__(self, model: Path, max_num_seqs: int, name: str = "engine alone") -> None:
        self.name = name
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # as `llm`'s num_threads 0
        runner = ModelRunner(str(model), device="cpu", max_num_seqs=max_num_seqs)
        self._engine = Engine(runner)
        self._engine.start()

    async def generate(self, spec: RequestSpec, first_token: FirstToken) -> int:
        sink = _CountingSink(asyncio.get_running_loop(), first_token)
        params = GenerationParams(
            prompt_ids=list(spec.prompt_ids),
            max_tokens=spec.max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        self._engine.submit(params, sink)
        return await sink.done

    async def aclose(self) -> None:
        """The engine outlives one measurement: `stop` ends it."""

    def stop(self) -> None:
        self._engine.stop()
