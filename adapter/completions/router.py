"""The POST /v1/completions route: validation by the body model, the rest in serving."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from adapter.completions.protocol import CompletionRequest, CompletionResponse
from adapter.deps import CompletionServingDep
from adapter.serving import SSE_HEADERS, JSONBody

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(request: CompletionRequest, serving: CompletionServingDep) -> Response:
    result = await serving.create_completion(request)
    if isinstance(result, JSONBody):
        return Response(result.text, media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
