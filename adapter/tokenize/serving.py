"""POST /tokenize (`preprocessing`) and /detokenize (`llm`'s prompt bytes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from adapter.context import current_request_id
from adapter.serving import OpenAIServing
from adapter.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from backend import contract


def decode(token_bytes: bytes) -> str:
    return token_bytes.decode("utf-8", errors="replace")


class OpenAIServingTokenization(OpenAIServing):
    """Tokenizes as generation does, so the ids are the ones the model would see."""

    tensor_params: ClassVar[Mapping[str, str]] = {
        contract.TEXT_INPUT: "prompt",
        contract.MESSAGES: "messages",
        contract.ADD_SPECIAL_TOKENS: "add_special_tokens",
        contract.ADD_GENERATION_PROMPT: "add_generation_prompt",
        contract.CONTINUE_FINAL_MESSAGE: "continue_final_message",
        contract.CHAT_TEMPLATE_KWARGS: "chat_template_kwargs",
        contract.INPUT_IDS: "tokens",
    }

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        _, info = await self.models.resolve(request.model)
        request_id = f"tokenize-{current_request_id()}"
        ids = await self.tokenize(request.to_generation_params(), request_id)
        token_strs = None
        if request.return_token_strs:
            pieces = await self.token_bytes(ids, request_id, parameter="prompt")
            token_strs = [decode(piece) for piece in pieces]
        return TokenizeResponse(
            count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=token_strs
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        await self.models.resolve(request.model)  # 404 for an unknown model
        request_id = f"detokenize-{current_request_id()}"
        pieces = await self.token_bytes(request.tokens, request_id, parameter="tokens")
        return DetokenizeResponse(prompt=decode(b"".join(pieces)))
