"""The POST /tokenize and /detokenize routes (vLLM's paths, no /v1)."""

from __future__ import annotations

from fastapi import APIRouter

from adapter.deps import TokenizationServingDep
from adapter.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, serving: TokenizationServingDep) -> TokenizeResponse:
    return await serving.create_tokenize(request)


@router.post("/detokenize")
async def detokenize(
    request: DetokenizeRequest, serving: TokenizationServingDep
) -> DetokenizeResponse:
    return await serving.create_detokenize(request)
