"""The Triton contract in one table, for both sides: every tensor (name, type, dims), which
model takes or sends it and whether it is optional, and the limits both sides check.

Imports nothing: the adapter, the engine, the tests and the benchmark all read it, and the
adapter must stay free of torch. `tests/backend/test_contract.py` holds it against every
config.pbtxt and docs/tensors.md, which documents each tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_TOP_K = 20
"""The most natural top-k logprobs the kernel returns (OpenAI's limit too)."""
DEFAULT_MAX_LOGPROBS = 20
"""`llm`'s `max_logprobs` when config.pbtxt does not set it: the largest LOGPROBS."""
DEFAULT_MAX_LOGPROB_TOKEN_IDS = 1024
"""`llm`'s `max_logprob_token_ids` when config.pbtxt does not set it."""
DEFAULT_MAX_NUM_SEQS = 16
"""`llm`'s `max_num_seqs` (sequences generating at once) when config.pbtxt does not set it."""
DEFAULT_MAX_QUEUE_SIZE = 256
"""`llm`'s `max_queue_size` (requests waiting for a slot) when config.pbtxt does not set it."""
MAX_STOP_STRINGS = 64
"""The most STOP strings a request may hold: each is searched after every token on the engine
thread, which all sequences share (OpenAI allows 4; 200k slowed another request 6x)."""
MAX_STOP_STRING_CHARS = 1024
"""The longest STOP string: a stop string's length less one is held back from the stream."""
MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024
"""The longest STRUCTURED_OUTPUT spec. Compile time and memory grow faster than its size (a
choice of 20k words, 292 KiB: 1.1 s and 49 MB; of 200k words: about 4 minutes on this VM, and
five of them held all compile threads while others' small specs timed out)."""
SERVER_BUSY = "server busy"
ENGINE_DIED = "the engine process died"
SHUTTING_DOWN = "the model is shutting down"
RETRY_LATER = (SERVER_BUSY, ENGINE_DIED, SHUTTING_DOWN)
"""How the errors of `llm` that another try may get past begin (UNAVAILABLE: the queue is full,
the engine is restarting or the model unloading). Over a gRPC stream only the message reaches
the client, so the adapter answers these with 503 and Retry-After by their first words."""
NO_TOKEN_FITS = "no token fits: "
"""How the error of a request whose bans left no id begins, after the tensor's name; the input
names that follow are the only free text of an `llm` error the adapter renames to its fields."""
NEG_INF_LOGPROB = -9999.0
"""-inf cannot travel through JSON clients; vLLM and this contract send it as -9999.0."""


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str
    """As config.pbtxt writes it (TYPE_STRING is BYTES on the wire)."""
    dims: tuple[int, ...]


TENSORS: dict[str, Tensor] = {}


def _tensor(name: str, data_type: str, *dims: int) -> str:
    TENSORS[name] = Tensor(name, f"TYPE_{data_type}", dims)
    return name


# --- inputs ------------------------------------------------------------------------------------
INPUT_IDS = _tensor("INPUT_IDS", "INT32", -1)  # also preprocessing's output
TEXT_INPUT = _tensor("TEXT_INPUT", "STRING", 1)
MESSAGES = _tensor("MESSAGES", "STRING", 1)  # a JSON list of chat messages
ADD_SPECIAL_TOKENS = _tensor("ADD_SPECIAL_TOKENS", "BOOL", 1)
ADD_GENERATION_PROMPT = _tensor("ADD_GENERATION_PROMPT", "BOOL", 1)  # MESSAGES only
CONTINUE_FINAL_MESSAGE = _tensor("CONTINUE_FINAL_MESSAGE", "BOOL", 1)  # MESSAGES only
CHAT_TEMPLATE_KWARGS = _tensor("CHAT_TEMPLATE_KWARGS", "STRING", 1)  # MESSAGES only: JSON object
MAX_TOKENS = _tensor("MAX_TOKENS", "INT32", 1)
TEMPERATURE = _tensor("TEMPERATURE", "FP32", 1)
TOP_P = _tensor("TOP_P", "FP32", 1)
TOP_K = _tensor("TOP_K", "INT32", 1)
MIN_P = _tensor("MIN_P", "FP32", 1)
SEED = _tensor("SEED", "INT64", 1)
STOP = _tensor("STOP", "STRING", -1)
STOP_TOKEN_IDS = _tensor("STOP_TOKEN_IDS", "INT32", -1)
IGNORE_EOS = _tensor("IGNORE_EOS", "BOOL", 1)
LOGPROBS = _tensor("LOGPROBS", "INT32", 1)
LOGPROB_TOKEN_IDS = _tensor("LOGPROB_TOKEN_IDS", "INT32", -1)
PROMPT_LOGPROBS = _tensor("PROMPT_LOGPROBS", "INT32", 1)
PROMPT_LOGPROB_TOKEN_IDS = _tensor("PROMPT_LOGPROB_TOKEN_IDS", "INT32", -1)
PRESENCE_PENALTY = _tensor("PRESENCE_PENALTY", "FP32", 1)
FREQUENCY_PENALTY = _tensor("FREQUENCY_PENALTY", "FP32", 1)
REPETITION_PENALTY = _tensor("REPETITION_PENALTY", "FP32", 1)
LOGIT_BIAS_IDS = _tensor("LOGIT_BIAS_IDS", "INT32", -1)
LOGIT_BIAS_VALUES = _tensor("LOGIT_BIAS_VALUES", "FP32", -1)  # as long as LOGIT_BIAS_IDS
ALLOWED_TOKEN_IDS = _tensor("ALLOWED_TOKEN_IDS", "INT32", -1)
MIN_TOKENS = _tensor("MIN_TOKENS", "INT32", 1)
INCLUDE_STOP_STR_IN_OUTPUT = _tensor("INCLUDE_STOP_STR_IN_OUTPUT", "BOOL", 1)
STRUCTURED_OUTPUT = _tensor("STRUCTURED_OUTPUT", "STRING", 1)  # JSON: backend/structured_output.py
# llm only: true = this request ends the one in flight with its request id (docs/tensors.md).
CANCEL = _tensor("CANCEL", "BOOL", 1)

# --- outputs: each streamed response carries the tokens since the last one (n) ------------------
OUTPUT_IDS = _tensor("OUTPUT_IDS", "INT32", -1)  # [n]
TEXT_OUTPUT = _tensor("TEXT_OUTPUT", "STRING", 1)
OUTPUT_TOKEN_BYTES = _tensor("OUTPUT_TOKEN_BYTES", "STRING", -1)  # [n]
OUTPUT_LOGPROBS = _tensor("OUTPUT_LOGPROBS", "FP32", -1)  # [n]
TOP_LOGPROB_IDS = _tensor("TOP_LOGPROB_IDS", "INT32", -1, -1)  # [n, k]
TOP_LOGPROBS = _tensor("TOP_LOGPROBS", "FP32", -1, -1)  # [n, k]
TOP_LOGPROB_TOKEN_BYTES = _tensor("TOP_LOGPROB_TOKEN_BYTES", "STRING", -1, -1)  # [n, k]
LOGPROB_TOKEN_LOGPROBS = _tensor("LOGPROB_TOKEN_LOGPROBS", "FP32", -1, -1)  # [n, M]
LOGPROB_TOKEN_BYTES = _tensor("LOGPROB_TOKEN_BYTES", "STRING", -1)  # [M] first, then [0]
FINISH_REASON = _tensor("FINISH_REASON", "STRING", 1)  # "" until the final response
# "" until the final response, then JSON: the stop string or stop token id that ended it, or null
STOP_REASON = _tensor("STOP_REASON", "STRING", 1)
PROMPT_TOKENS = _tensor("PROMPT_TOKENS", "INT32", 1)
COMPLETION_TOKENS = _tensor("COMPLETION_TOKENS", "INT32", 1)  # cumulative
# Prompt logprobs, on the first response when PROMPT_LOGPROBS or PROMPT_LOGPROB_TOKEN_IDS is
# given, zero-size otherwise. Position i (1..P-1) scores prompt token i given the tokens before.
PROMPT_IDS = _tensor("PROMPT_IDS", "INT32", -1)  # [P]
PROMPT_TOKEN_BYTES = _tensor("PROMPT_TOKEN_BYTES", "STRING", -1)  # [P]
PROMPT_TOKEN_LOGPROBS = _tensor("PROMPT_TOKEN_LOGPROBS", "FP32", -1)  # [P-1]
PROMPT_TOP_LOGPROB_IDS = _tensor("PROMPT_TOP_LOGPROB_IDS", "INT32", -1, -1)  # [P-1, k]
PROMPT_TOP_LOGPROBS = _tensor("PROMPT_TOP_LOGPROBS", "FP32", -1, -1)  # [P-1, k]
PROMPT_TOP_LOGPROB_TOKEN_BYTES = _tensor("PROMPT_TOP_LOGPROB_TOKEN_BYTES", "STRING", -1, -1)
PROMPT_LOGPROB_TOKEN_LOGPROBS = _tensor("PROMPT_LOGPROB_TOKEN_LOGPROBS", "FP32", -1, -1)
PROMPT_LOGPROB_TOKEN_BYTES = _tensor("PROMPT_LOGPROB_TOKEN_BYTES", "STRING", -1)  # [M]
TOKEN_BYTES = _tensor("TOKEN_BYTES", "STRING", -1)  # preprocessing: the bytes of INPUT_IDS

# --- groups ------------------------------------------------------------------------------------
PROMPT_INPUTS = (
    TEXT_INPUT,
    MESSAGES,
    ADD_SPECIAL_TOKENS,
    ADD_GENERATION_PROMPT,
    CONTINUE_FINAL_MESSAGE,
    CHAT_TEMPLATE_KWARGS,
)
"""What `preprocessing` turns into INPUT_IDS."""
GENERATION_INPUTS = (
    MAX_TOKENS,
    TEMPERATURE,
    TOP_P,
    TOP_K,
    MIN_P,
    SEED,
    STOP,
    STOP_TOKEN_IDS,
    IGNORE_EOS,
    LOGPROBS,
    LOGPROB_TOKEN_IDS,
    PROMPT_LOGPROBS,
    PROMPT_LOGPROB_TOKEN_IDS,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    REPETITION_PENALTY,
    LOGIT_BIAS_IDS,
    LOGIT_BIAS_VALUES,
    ALLOWED_TOKEN_IDS,
    MIN_TOKENS,
    INCLUDE_STOP_STR_IN_OUTPUT,
    STRUCTURED_OUTPUT,
)
"""The optional inputs of `llm` (and `ensemble`, which forwards them)."""
# Output groups, so that a client asks only for what it reads (`requested_output_names`).
ALWAYS_OUTPUTS = (OUTPUT_IDS, TEXT_OUTPUT, FINISH_REASON, PROMPT_TOKENS, COMPLETION_TOKENS)
SAMPLED_LOGPROB_OUTPUTS = (OUTPUT_LOGPROBS, OUTPUT_TOKEN_BYTES)
TOP_LOGPROB_OUTPUTS = (TOP_LOGPROB_IDS, TOP_LOGPROBS, TOP_LOGPROB_TOKEN_BYTES)
TOKEN_ID_LOGPROB_OUTPUTS = (LOGPROB_TOKEN_LOGPROBS, LOGPROB_TOKEN_BYTES)
PROMPT_OUTPUTS = (
    PROMPT_IDS,
    PROMPT_TOKEN_BYTES,
    PROMPT_TOKEN_LOGPROBS,
    PROMPT_TOP_LOGPROB_IDS,
    PROMPT_TOP_LOGPROBS,
    PROMPT_TOP_LOGPROB_TOKEN_BYTES,
    PROMPT_LOGPROB_TOKEN_LOGPROBS,
    PROMPT_LOGPROB_TOKEN_BYTES,
)
LLM_OUTPUTS = (
    *ALWAYS_OUTPUTS,
    STOP_REASON,
    *SAMPLED_LOGPROB_OUTPUTS,
    *TOP_LOGPROB_OUTPUTS,
    *TOKEN_ID_LOGPROB_OUTPUTS,
    *PROMPT_OUTPUTS,
)


def requested_outputs(
    *, logprobs: int | None, token_ids: bool, prompt_logprobs: bool, stop_rules: bool = False
) -> tuple[str, ...]:
    """The `llm` outputs a request with these inputs reads, so that the model builds and sends
    nothing else: LOGPROBS (None = absent; 0 = the sampled token's logprob only) asks for the
    sampled group, and for k >= 1 the natural top-k unless explicit ids take its place (a
    client that sends LOGPROB_TOKEN_IDS sends LOGPROBS=0: its alternatives are the ids). Each
    tensor costs a response its fixed cost whatever its size (docs/design.md, "Streaming
    responses"), so an empty top-k is not asked for, nor STOP_REASON without stop strings or
    stop ids (`stop_rules`): it is then null but for a model's second EOS id (docs/openai.md)."""
    names: tuple[str, ...] = ALWAYS_OUTPUTS
    if stop_rules:
        names += (STOP_REASON,)
    if logprobs is not None or token_ids:
        names += SAMPLED_LOGPROB_OUTPUTS
    if token_ids:
        names += TOKEN_ID_LOGPROB_OUTPUTS
    elif logprobs:
        names += TOP_LOGPROB_OUTPUTS
    if prompt_logprobs:
        names += PROMPT_OUTPUTS
    return names


@dataclass(frozen=True)
class ModelTensors:
    """One model's side of the contract."""

    inputs: Mapping[str, bool]
    """Input name -> optional."""
    outputs: frozenset[str]


MODELS: dict[str, ModelTensors] = {
    # INPUT_IDS is optional in config.pbtxt only so that a CANCEL request may leave it out.
    "llm": ModelTensors(
        {INPUT_IDS: True, **dict.fromkeys(GENERATION_INPUTS, True), CANCEL: True},
        frozenset(LLM_OUTPUTS),
    ),
    "preprocessing": ModelTensors(
        {**dict.fromkeys(PROMPT_INPUTS, True), INPUT_IDS: True}, frozenset({INPUT_IDS, TOKEN_BYTES})
    ),
    "ensemble": ModelTensors(
        {**dict.fromkeys(PROMPT_INPUTS, True), **dict.fromkeys(GENERATION_INPUTS, True)},
        frozenset(LLM_OUTPUTS),
    ),
}

INPUT_NAMES = frozenset(name for model in MODELS.values() for name in model.inputs)
"""Every input of any model: an error message naming one is the request's fault."""
