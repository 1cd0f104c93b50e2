"""The POST /v1/chat/completions route: validation by the body model, the rest in serving."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from adapter.chat.protocol import ChatCompletionRequest, ChatCompletionResponse
from adapter.deps import ChatServingDep
from adapter.serving import SSE_HEADERS, JSONBody

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    request: ChatCompletionRequest, serving: ChatServingDep
) -> Response:
    result = await serving.create_chat_completion(request)
    if isinstance(result, JSONBody):
        return Response(result.text, media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
