"""An asyncio load generator: N streaming requests at concurrency C against one target.

Targets are pluggable: Triton's `llm` over a gRPC stream (`TritonTarget`), any OpenAI
completions or chat server that streams server-sent events (`OpenAITarget`: the adapter, or
`transformers serve`), and the engine alone (`bench.engine_alone`). Each request records when
it was sent, when its first token arrived, when it ended and how many tokens it produced, so
time to first token (TTFT), time per output token (TPOT) and aggregate throughput come from the
same numbers for every target. Everything is bounded: a fixed list of requests, a deadline per
request and one for the whole run; URLs are meant to be loopback and proxies from the
environment are ignored.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import grpc
import numpy as np

from backend import contract

if TYPE_CHECKING:
    # tritonclient is imported where used: the engine-alone target runs on the GPU image, which
    # has none (docs/design.md, "The prepared GPU check").
    import tritonclient.grpc.aio as grpcclient_aio
    from transformers import PreTrainedTokenizerBase
    from tritonclient.grpc import InferInput

PROMPT_LENGTHS = (16, 64, 128)
OUTPUT_LENGTHS = (32, 64, 128)
EXPLICIT_ID_COUNT = 1024
"""How many explicit ids the explicit-ids rows ask for, per request."""
# Made-up words for prompts: text the generated tokenizer splits into ordinary tokens, far from
# the memorised passage, so a greedy model rarely produces EOS after it.
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: the same prompt as ids and as text, and its output length."""

    prompt_ids: tuple[int, ...]
    prompt_text: str
    max_tokens: int


def _prompt(
    tokenizer: PreTrainedTokenizerBase, length: int, rng: random.Random, attempts: int = 50
) -> str:
    """Text of exactly `length` tokens that encodes back to the same ids.

    Both sides then see the same tokens: our targets get the ids, `transformers serve` (text
    prompts only) tokenizes the text with the same tokenizer.
    """
    for _ in range(attempts):
        words = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            for _ in range(2 * length)
        ]
        ids = tokenizer.encode(" ".join(words))[:length]
        text = str(tokenizer.decode(ids))
        if len(ids) == length and tokenizer.encode(text) == ids:
            return text
    raise RuntimeError(f"no prompt of {length} tokens round-trips through the tokenizer")


def make_workload(
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    prompt_lengths: Sequence[int] = PROMPT_LENGTHS,
    output_lengths: Sequence[int] = OUTPUT_LENGTHS,
    seed: int = 0,
) -> list[RequestSpec]:
    """`count` requests cycling through every (prompt length, output length) pair.

    In Latin-square order: with as many prompt as output lengths, every run of that many
    consecutive requests holds each prompt length and each output length once, so a short run
    has the same mean lengths as a long one.
    """
    rng = random.Random(seed)
    specs = []
    for index in range(count):
        prompt_length = prompt_lengths[index % len(prompt_lengths)]
        max_tokens = output_lengths[(index + index // len(prompt_lengths)) % len(output_lengths)]
        text = _prompt(tokenizer, prompt_length, rng)
        specs.append(RequestSpec(tuple(tokenizer.encode(text)), text, max_tokens))
    return specs


def explicit_ids(vocab_size: int, count: int = EXPLICIT_ID_COUNT) -> list[int]:
    """`count` distinct ids spread over the whole vocabulary: the labels a request of the
    explicit-ids rows asks logprobs for."""
    step = max(vocab_size // count, 1)
    return list(range(0, step * count, step))[:count]


FirstToken = Callable[[], None]


class Target(Protocol):
    """A server under load. `generate` streams one request, calls `first_token` when its first
    token arrives and returns how many tokens it generated."""

    name: str

    async def generate(self, spec: RequestSpec, first_token: FirstToken) -> int: ...

    async def aclose(self) -> None: ...


def _tensor(name: str, array: np.ndarray) -> InferInput:
    from tritonclient.grpc import InferInput
    from tritonclient.utils import np_to_triton_dtype

    tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


_GRPC_CHANNEL_ARGS = [
    # What tritonclient sets when given no channel args, plus: never route loopback via a proxy.
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.enable_http_proxy", 0),
]


class TritonTarget:
    """Triton's `llm` model: token-id prompts, greedy, a fixed output length (IGNORE_EOS).

    One gRPC stream per request, as a client serving independent users would open. With
    `logprob_token_ids` every request also asks for those ids' logprobs at every position
    (and LOGPROBS=0, the sampled token's), and the first response is checked to carry them.
    `logprobs` sends LOGPROBS on its own (0: only the sampled token's logprob).
    """

    def __init__(
        self,
        url: str,
        model: str = "llm",
        logprob_token_ids: Sequence[int] = (),
        name: str = "",
        logprobs: int | None = None,
    ) -> None:
        self.name = name or f"triton-grpc:{model}"
        self._model = model
        self._url = url
        self._explicit = np.array(logprob_token_ids, dtype=np.int32)
        self._logprobs = 0 if self._explicit.size and logprobs is None else logprobs
        # What the adapter asks for with and without logprobs: the model builds only these.
        self._outputs = contract.requested_outputs(
            logprobs=self._logprobs, token_ids=bool(self._explicit.size), prompt_logprobs=False
        )
        self._client: grpcclient_aio.InferenceServerClient | None = None

    @property
    def client(self) -> grpcclient_aio.InferenceServerClient:
        """Made on first use: a gRPC aio channel belongs to the event loop it was made in."""
        if self._client is None:
            import tritonclient.grpc.aio as grpcclient_aio

            self._client = grpcclient_aio.InferenceServerClient(
                self._url, channel_args=_GRPC_CHANNEL_ARGS
            )
        return self._client

    def _inputs(self, spec: RequestSpec) -> list[InferInput]:
        inputs = [
            _tensor(contract.INPUT_IDS, np.array(spec.prompt_ids, dtype=np.int32)),
            _tensor(contract.MAX_TOKENS, np.array([spec.max_tokens], dtype=np.int32)),
            _tensor(contract.TEMPERATURE, np.array([0.0], dtype=np.float32)),
            _tensor(contract.IGNORE_EOS, np.array([True])),
        ]
        if self._logprobs is not None:
            inputs.append(_tensor(contract.LOGPROBS, np.array([self._logprobs], dtype=np.int32)))
        if self._explicit.size:
            inputs.append(_tensor(contract.LOGPROB_TOKEN_IDS, self._explicit))
        return inputs

    async def generate(self, spec: RequestSpec, first_token: FirstToken) -> int:
        from tritonclient.grpc import InferRequestedOutput

        request = {
            "model_name": self._model,
            "inputs": self._inputs(spec),
            "outputs": [InferRequestedOutput(name) for name in self._outputs],
        }
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            # Keep our side of the stream open until the final response has arrived.
            await finished.wait()

        call = self.client.stream_infer(requests())
        tokens, checked, completed = 0, self._logprobs is None, False
        try:
            async for result, error in call:
                if error is not None:
                    raise RuntimeError(f"{self._model}: {error.message()}")
                new = result.as_numpy(contract.OUTPUT_IDS).size
                if new and not tokens:
                    first_token()
                tokens += new
                if new and not checked:
                    self._check_logprobs(result, new)
                    checked = True
                if result.get_response().parameters["triton_final_response"].bool_param:
                    completed = True
                    finished.set()
                    async for _ in call:  # half-closed: Triton ends the RPC
                        pass
                    return tokens
            raise RuntimeError(f"the stream of {self._model} ended before the final response")
        except grpc.RpcError as exc:
            raise RuntimeError(f"{self._model}: {exc}") from exc
        finally:
            finished.set()
            if not completed:  # after an error or a timeout Triton stops generating for it
                call.cancel()  # never after the final: docs/design.md, "Streaming responses"

    def _check_logprobs(self, result: Any, new: int) -> None:
        """The response's logprob tensors have the shapes asked for."""
        expected = {contract.OUTPUT_LOGPROBS: [new]}
        if self._explicit.size:
            expected[contract.LOGPROB_TOKEN_LOGPROBS] = [new, self._explicit.size]
        for name, shape in expected.items():
            got = list(result.get_output(name).shape)
            if got != shape:
                raise RuntimeError(f"{name} has shape {got}, not {shape}")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class OpenAITarget:
    """POST /v1/completions (or /v1/chat/completions with `chat`) with `stream: true`, greedy,
    `max_tokens` per request.

    `token_ids` sends the completion prompt as token ids (our adapter), else as text
    (`transformers serve` accepts strings only); a chat request sends the text as one user
    message. `extra` is merged into every body (`ignore_eos`, `stream_options`). The token count
    is the final usage's `completion_tokens` when the server sends it, else the number of
    chunks that carry text.

    The client is aiohttp, as vLLM's serving benchmark uses: it shares the CPUs with the servers,
    and at C=16 took 0.09 of a core where httpx took 0.19 (bench/RESULTS.md, "The adapter's
    CPU priority, and a lighter client").
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        name: str,
        *,
        chat: bool = False,
        token_ids: bool = False,
        extra: Mapping[str, Any] | None = None,
        concurrency: int = 16,
        timeout_s: float = 300.0,
    ) -> None:
        self.name = name
        self._model = model
        self._chat = chat
        self._token_ids = token_ids and not chat
        self._extra = dict(extra or {})
        self._base_url = base_url
        self._concurrency = concurrency
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made on first use: an aiohttp session belongs to the event loop it was made in."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                self._base_url,
                connector=aiohttp.TCPConnector(limit=self._concurrency),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                trust_env=False,
            )
        return self._session

    @property
    def _path(self) -> str:
        return "/v1/chat/completions" if self._chat else "/v1/completions"

    def _body(self, spec: RequestSpec) -> dict[str, Any]:
        if self._chat:
            prompt: dict[str, Any] = {"messages": [{"role": "user", "content": spec.prompt_text}]}
        else:
            prompt = {"prompt": list(spec.prompt_ids) if self._token_ids else spec.prompt_text}
        return {
            "model": self._model,
            **prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0,
            "stream": True,
            **self._extra,
        }

    def _text(self, choice: Mapping[str, Any]) -> str | None:
        if self._chat:
            return (choice.get("delta") or {}).get("content")
        return choice.get("text")

    async def generate(self, spec: RequestSpec, first_token: FirstToken) -> int:
        chunks, usage = 0, None
        async with self.session.post(self._path, json=self._body(spec)) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.read())[:300]!r}")
            async for raw in reply.content:  # line by line
                line = raw.decode()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    # A chunk that only carries a role or the finish reason is not a token; a
                    # completion chunk may be one whose text is held back (part of a character).
                    if self._text(choice) or (
                        not self._chat and choice.get("finish_reason") is None
                    ):
                        if not chunks:
                            first_token()
                        chunks += 1
        return usage["completion_tokens"] if usage else chunks

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(frozen=True)
class RequestResult:
    """Timestamps (perf_counter seconds) and counts of one request."""

    spec: RequestSpec
    start: float
    first_token: float | None
    end: float
    tokens: int
    error: str | None = None


async def _timed(target: Target, spec: RequestSpec, timeout_s: float) -> RequestResult:
    first: list[float] = []

    def first_token() -> None:
        if not first:
            first.append(time.perf_counter())

    start = time.perf_counter()
    try:
        tokens = await asyncio.wait_for(target.generate(spec, first_token), timeout_s)
    except Exception as exc:  # recorded and counted: one failed request must not end the run
        return RequestResult(
            spec, start, None, time.perf_counter(), 0, f"{type(exc).__name__}: {exc}"
        )
    return RequestResult(spec, start, first[0] if first else None, time.perf_counter(), tokens)


@dataclass(frozen=True)
class LoadResult:
    target: str
    concurrency: int
    wall_s: float
    requests: list[RequestResult]


async def run_load(
    target: Target,
    specs: Sequence[RequestSpec],
    concurrency: int,
    request_timeout_s: float = 300.0,
    total_timeout_s: float = 900.0,
) -> LoadResult:
    """Sends `specs` in order with at most `concurrency` requests in flight (closed loop)."""
    pending = iter(specs)
    results: list[RequestResult] = []

    async def worker() -> None:
        for spec in pending:  # shared: each spec goes to the next free worker
            results.append(await _timed(target, spec, request_timeout_s))

    start = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs))))), total_timeout_s
    )
    return LoadResult(target.name, concurrency, time.perf_counter() - start, results)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between ranks as numpy's default."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """The reported numbers of one load run; times in seconds."""

    target: str
    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    expected_tokens: int
    wall_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    first_error: str | None
    # The share of all CPUs that other processes used meanwhile, where the runner measured it.
    others_cpu: float = float("nan")
    # The share of the run during which the served engine waited for a CPU (bench.environment).
    engine_waiting: float = float("nan")
    # CPU seconds the benchmark's own processes (servers and client) used in the run.
    ours_cpu_s: float = float("nan")

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def cpu_ms_per_token(self) -> float:
        """`ours_cpu_s` per output token, in ms: what a token cost every process serving it."""
        return 1e3 * self.ours_cpu_s / self.output_tokens if self.output_tokens else float("nan")

    @property
    def requests_per_s(self) -> float:
        return (self.requests - self.errors) / self.wall_s

    @classmethod
    def from_load(cls, load: LoadResult) -> Summary:
        done = [r for r in load.requests if r.error is None]
        failed = [r for r in load.requests if r.error is not None]
        ttft = [r.first_token - r.start for r in done if r.first_token is not None]
        tpot = [
            (r.end - r.first_token) / (r.tokens - 1)
            for r in done
            if r.first_token is not None and r.tokens > 1
        ]
        return cls(
            target=load.target,
            concurrency=load.concurrency,
            requests=len(load.requests),
            errors=len(failed),
            output_tokens=sum(r.tokens for r in done),
            expected_tokens=sum(r.spec.max_tokens for r in load.requests),
            wall_s=load.wall_s,
            ttft_p50=percentile(ttft, 50),
            ttft_p99=percentile(ttft, 99),
            tpot_p50=percentile(tpot, 50),
            tpot_p99=percentile(tpot, 99),
            first_error=failed[0].error if failed else None,
        )
