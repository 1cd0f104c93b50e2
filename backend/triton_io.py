"""Tensor names of the Triton contract, and numpy arrays <-> engine params/outputs.

Every name is a constant here so a typo fails at import time. This module imports only numpy:
the adapter uses the names too and must stay free of torch.
"""

# --- inputs of `llm` (and of `ensemble`, which forwards them) ---------------------------------
INPUT_IDS = "INPUT_IDS"  # INT32 [-1], llm only
TEXT_INPUT = "TEXT_INPUT"  # BYTES [1], ensemble / preprocessing only
MESSAGES = "MESSAGES"  # BYTES [1] JSON list of chat messages, ensemble / preprocessing only
ADD_SPECIAL_TOKENS = "ADD_SPECIAL_TOKENS"  # BOOL [1], preprocessing only
MAX_TOKENS = "MAX_TOKENS"  # INT32 [1]
TEMPERATURE = "TEMPERATURE"  # FP32 [1]
TOP_P = "TOP_P"  # FP32 [1]
TOP_K = "TOP_K"  # INT32 [1]
SEED = "SEED"  # INT64 [1]
STOP = "STOP"  # BYTES [-1]
STOP_TOKEN_IDS = "STOP_TOKEN_IDS"  # INT32 [-1]
IGNORE_EOS = "IGNORE_EOS"  # BOOL [1]
LOGPROBS = "LOGPROBS"  # INT32 [1]
LOGPROB_TOKEN_IDS = "LOGPROB_TOKEN_IDS"  # INT32 [-1]

# --- outputs of every streamed response (deltas) ----------------------------------------------
OUTPUT_IDS = "OUTPUT_IDS"  # INT32 [n]
TEXT_OUTPUT = "TEXT_OUTPUT"  # BYTES [1]
OUTPUT_LOGPROBS = "OUTPUT_LOGPROBS"  # FP32 [n]
OUTPUT_TOKEN_BYTES = "OUTPUT_TOKEN_BYTES"  # BYTES [n]
TOP_LOGPROB_IDS = "TOP_LOGPROB_IDS"  # INT32 [n, k]
TOP_LOGPROBS = "TOP_LOGPROBS"  # FP32 [n, k]
TOP_LOGPROB_TOKEN_BYTES = "TOP_LOGPROB_TOKEN_BYTES"  # BYTES [n, k]
LOGPROB_TOKEN_LOGPROBS = "LOGPROB_TOKEN_LOGPROBS"  # FP32 [n, M]
LOGPROB_TOKEN_BYTES = "LOGPROB_TOKEN_BYTES"  # BYTES [M] on the first response, [0] after
FINISH_REASON = "FINISH_REASON"  # BYTES [1], "" until the final response
PROMPT_TOKENS = "PROMPT_TOKENS"  # INT32 [1]
COMPLETION_TOKENS = "COMPLETION_TOKENS"  # INT32 [1], cumulative
