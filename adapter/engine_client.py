"""What serving needs from Triton, as an interface: `EngineClient`, and the model limits it reads
(`ModelInfo`). `adapter.triton_client` implements it over gRPC; unit tests pass a fake."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Protocol

from adapter.tensors import TritonOutput, TritonRequest
from backend import contract


@dataclass(frozen=True)
class ModelInfo:
    """The `llm` model's config parameters the adapter validates against (read once, cached)."""

    max_model_len: int | None = None
    max_logprobs: int = contract.DEFAULT_MAX_LOGPROBS
    max_logprob_token_ids: int = contract.DEFAULT_MAX_LOGPROB_TOKEN_IDS
    max_num_seqs: int = contract.DEFAULT_MAX_NUM_SEQS
    max_queue_size: int = contract.DEFAULT_MAX_QUEUE_SIZE
    model_path: str | None = None

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> ModelInfo:
        """Parses config.pbtxt `parameters` (all strings); an absent one keeps the default."""
        defaults = cls()

        def integer(name: str, default: int) -> int:
            value = parameters.get(name, "").strip()
            return int(value) if value else default

        return cls(
            # 0 means "the model's own context", which only the model knows.
            max_model_len=integer("max_model_len", 0) or None,
            max_logprobs=integer("max_logprobs", defaults.max_logprobs),
            max_logprob_token_ids=integer("max_logprob_token_ids", defaults.max_logprob_token_ids),
            max_num_seqs=integer("max_num_seqs", defaults.max_num_seqs),
            max_queue_size=integer("max_queue_size", defaults.max_queue_size),
            model_path=parameters.get("model_path") or None,
        )

    @property
    def max_requests_at_once(self) -> int:
        """The most Triton requests one API request may make: all of them fit the engine on an
        idle server (every slot, then the wait queue, which also takes the slots a smaller KV
        budget leaves out: `backend.engine_process.build_engine`)."""
        return self.max_num_seqs + self.max_queue_size

    @property
    def default_model_name(self) -> str:
        """The API model id when none is configured: the model folder's name."""
        return PurePath(self.model_path).name if self.model_path else "llm"


class EngineClient(Protocol):
    """What serving needs from Triton."""

    async def is_ready(self) -> bool:
        """Triton is up and the models the adapter calls are ready."""
        ...

    async def model_info(self) -> ModelInfo:
        """The generation model's limits; raises `EngineUnavailableError` if unreachable."""
        ...

    async def tokenize(self, params: TritonRequest, request_id: str) -> list[int]:
        """The ids of a text or chat prompt (`preprocessing`); raises as `generate` does."""
        ...

    async def token_bytes(self, ids: Sequence[int], request_id: str) -> list[bytes]:
        """Each id's bytes (`preprocessing` detokenizes); raises as `generate` does."""
        ...

    def generate(
        self, params: TritonRequest, request_id: str
    ) -> AsyncGenerator[TritonOutput, None]:
        """Streams the model's responses, the last one `final`; closing it cancels the request.

        Raises `TritonInputError` for input the model rejected, `EngineUnavailableError` when
        Triton or the model is not there, `EngineError` otherwise.
        """
        ...

    async def close(self) -> None:
        """Releases the connection."""
        ...
