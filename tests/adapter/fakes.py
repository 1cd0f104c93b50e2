"""A fake of the engine seam (`adapter.engine_client.EngineClient`) and Triton response arrays."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapter.engine_client import ModelInfo
from adapter.errors import EngineUnavailableError
from adapter.tensors import TritonOutput, TritonRequest
from backend import contract

Token = tuple[int, bytes, float]


def response_arrays(
    tokens: Sequence[Token] = (),
    text: str | None = None,
    *,
    logprobs: bool = True,
    top: Sequence[Sequence[Token]] | None = None,
    requested: Sequence[Sequence[float]] | None = None,
    requested_bytes: Sequence[bytes] = (),
    finish_reason: str = "",
    stop_reason: str | int | None = None,
    prompt_tokens: int = 3,
    completion_tokens: int = 0,
    prompt: Sequence[Token] = (),
    prompt_top: Sequence[Sequence[Token]] | None = None,
    prompt_requested: Sequence[Sequence[float]] | None = None,
    prompt_requested_bytes: Sequence[bytes] = (),
) -> dict[str, np.ndarray]:
    """The arrays of one streamed response, shaped as the model sends them.

    `text` defaults to the tokens' bytes joined; `top` holds k (id, bytes, logprob) per
    position; `requested` the M logprobs of the requested ids per position. `prompt` holds the
    prompt's tokens (the first one's logprob unused), `prompt_top` and `prompt_requested` the
    rows of prompt positions 1..P-1, `prompt_requested_bytes` the bytes of their M ids.
    """
    n = len(tokens)
    k = len(top[0]) if top else 0
    m = len(requested[0]) if requested else 0
    top = top or [[] for _ in range(n)]
    joined = b"".join(t[1] for t in tokens).decode("utf-8", errors="replace")
    return {
        **_prompt_arrays(prompt, prompt_top, prompt_requested, prompt_requested_bytes),
        contract.OUTPUT_IDS: np.array([t[0] for t in tokens], dtype=np.int32),
        contract.TEXT_OUTPUT: np.array(
            [(joined if text is None else text).encode()], dtype=np.object_
        ),
        contract.OUTPUT_TOKEN_BYTES: np.array([t[1] for t in tokens], dtype=np.object_),
        contract.OUTPUT_LOGPROBS: np.array([t[2] for t in tokens] if logprobs else [], np.float32),
        contract.TOP_LOGPROB_IDS: np.array([[e[0] for e in row] for row in top], np.int32).reshape(
            n, k
        ),
        contract.TOP_LOGPROBS: np.array([[e[2] for e in row] for row in top], np.float32).reshape(
            n, k
        ),
        contract.TOP_LOGPROB_TOKEN_BYTES: np.array(
            [[e[1] for e in row] for row in top], dtype=np.object_
        ).reshape(n, k),
        contract.LOGPROB_TOKEN_LOGPROBS: np.array(requested or [], np.float32).reshape(n, m),
        contract.LOGPROB_TOKEN_BYTES: np.array(list(requested_bytes), dtype=np.object_),
        contract.FINISH_REASON: np.array([finish_reason.encode()], dtype=np.object_),
        contract.STOP_REASON: np.array(
            [json.dumps(stop_reason).encode() if finish_reason else b""], dtype=np.object_
        ),
        contract.PROMPT_TOKENS: np.array([prompt_tokens], dtype=np.int32),
        contract.COMPLETION_TOKENS: np.array([completion_tokens], dtype=np.int32),
    }


def _prompt_arrays(
    prompt: Sequence[Token],
    top: Sequence[Sequence[Token]] | None,
    requested: Sequence[Sequence[float]] | None,
    requested_bytes: Sequence[bytes],
) -> dict[str, np.ndarray]:
    rows = max(len(prompt) - 1, 0)
    k = len(top[0]) if top else 0
    m = len(requested[0]) if requested else 0
    top = top or [[] for _ in range(rows)]
    return {
        contract.PROMPT_IDS: np.array([t[0] for t in prompt], dtype=np.int32),
        contract.PROMPT_TOKEN_BYTES: np.array([t[1] for t in prompt], dtype=np.object_),
        contract.PROMPT_TOKEN_LOGPROBS: np.array([t[2] for t in prompt[1:]], np.float32),
        contract.PROMPT_TOP_LOGPROB_IDS: np.array(
            [[e[0] for e in row] for row in top], np.int32
        ).reshape(rows, k),
        contract.PROMPT_TOP_LOGPROBS: np.array(
            [[e[2] for e in row] for row in top], np.float32
        ).reshape(rows, k),
        contract.PROMPT_TOP_LOGPROB_TOKEN_BYTES: np.array(
            [[e[1] for e in row] for row in top], dtype=np.object_
        ).reshape(rows, k),
        contract.PROMPT_LOGPROB_TOKEN_LOGPROBS: np.array(requested or [], np.float32).reshape(
            rows, m
        ),
        contract.PROMPT_LOGPROB_TOKEN_BYTES: np.array(list(requested_bytes), dtype=np.object_),
    }


def output(**kwargs: Any) -> TritonOutput:
    """A `TritonOutput` parsed from `response_arrays(**kwargs)`; final when it has a reason."""
    arrays = response_arrays(**kwargs)
    return TritonOutput.from_arrays(arrays, final=bool(kwargs.get("finish_reason")))


Script = list[TritonOutput | BaseException | asyncio.Event]


def byte_token(token_id: int) -> bytes:
    """The fake vocabulary: id i is the byte i (so `FakeEngine.tokenize` round-trips)."""
    return bytes([token_id % 256])


@dataclass
class FakeEngine:
    """Plays `script` for every request (or `respond(params)`'s script when set): outputs are
    yielded, exceptions raised. `tokenize` gives a text's UTF-8 bytes as ids, `tokens[text]`
    when listed; `token_bytes` gives id i the byte i.

    An `asyncio.Event` in the script blocks the stream until set, which lets tests cancel a
    request in flight; `closed` counts streams that were closed (normally or not), `finished`
    those that played their whole script. `entered`, when set, is called as a stream starts,
    so a test knows a request reached the engine.
    """

    script: Script = field(default_factory=list)
    respond: Callable[[TritonRequest], Script] | None = None
    tokens: dict[str, list[int]] = field(default_factory=dict)
    tokenized: list[TritonRequest] = field(default_factory=list)
    detokenized: list[tuple[int, ...]] = field(default_factory=list)
    bytes_error: Exception | None = None
    info: ModelInfo = field(
        default_factory=lambda: ModelInfo(
            max_model_len=64, max_logprobs=5, max_logprob_token_ids=8, model_path="/models/tiny"
        )
    )
    ready: bool = True
    reachable: bool = True
    requests: list[tuple[TritonRequest, str]] = field(default_factory=list)
    closed: int = 0
    finished: int = 0
    entered: Callable[[TritonRequest, str], None] | None = None

    async def is_ready(self) -> bool:
        return self.ready

    async def model_info(self) -> ModelInfo:
        if not self.reachable:
            raise EngineUnavailableError("Triton is not reachable: connection refused")
        return self.info

    async def tokenize(self, params: TritonRequest, request_id: str) -> list[int]:
        self.tokenized.append(params)
        return self._prompt_ids(params)

    def _prompt_ids(self, params: TritonRequest) -> list[int]:
        if params.prompt_ids is not None:
            return list(params.prompt_ids)
        text = params.text if params.text is not None else str(params.messages)
        return self.tokens.get(text, list(text.encode()))

    async def token_bytes(self, ids: Sequence[int], request_id: str) -> list[bytes]:
        self.detokenized.append(tuple(ids))
        if self.bytes_error is not None:
            raise self.bytes_error
        return [byte_token(i) for i in ids]

    async def generate(
        self, params: TritonRequest, request_id: str
    ) -> AsyncGenerator[TritonOutput, None]:
        # As the Triton client: the prompt's tokens are known only now.
        params.check_fits_context(len(self._prompt_ids(params)), self.info.max_model_len)
        self.requests.append((params, request_id))
        if self.entered is not None:
            self.entered(params, request_id)
        script = self.script if self.respond is None else self.respond(params)
        try:
            for item in script:
                if isinstance(item, asyncio.Event):
                    await item.wait()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
            self.finished += 1
        finally:
            self.closed += 1

    async def close(self) -> None:
        pass


def model_script(params: TritonRequest) -> Script:
    """What a well-behaved model answers to any `params`: one final response shaped as the
    contract says (k natural alternatives, M requested columns, prompt rows when prompt
    logprobs are asked for), so that every valid request succeeds."""
    tokens = [(97, b"a", -0.5)] if params.max_tokens != 0 else []
    k = params.logprobs or 0
    m = len(params.logprob_token_ids)
    prompt: list[Token] = []
    prompt_top = prompt_requested = None
    if params.prompt_logprobs is not None or params.prompt_logprob_token_ids:
        ids = params.prompt_ids or tuple((params.text or str(params.messages)).encode()) or (1,)
        prompt = [(i, byte_token(i), -1.0) for i in ids]
        rows = len(prompt) - 1
        pk = params.prompt_logprobs or 0
        pm = len(params.prompt_logprob_token_ids)
        prompt_top = [[(98, b"b", -2.0)] * pk for _ in range(rows)] if pk else None
        prompt_requested = [[-3.0] * pm for _ in range(rows)] if pm else None
    return [
        output(
            tokens=tokens,
            top=[[(98 + j, b"b", -1.0 - j) for j in range(k)] for _ in tokens] if k else None,
            requested=[[-2.0] * m for _ in tokens] if m and tokens else None,
            requested_bytes=[b"x"] * m,
            prompt=prompt,
            prompt_top=prompt_top,
            prompt_requested=prompt_requested,
            prompt_requested_bytes=[byte_token(i) for i in params.prompt_logprob_token_ids],
            finish_reason="length",
            prompt_tokens=max(len(prompt), 1),
            completion_tokens=len(tokens),
        )
    ]
