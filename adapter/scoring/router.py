"""The POST /generative_scoring route (vLLM's path, no /v1)."""

from __future__ import annotations

from fastapi import APIRouter

from adapter.deps import ScoringServingDep
from adapter.scoring.protocol import GenerativeScoringRequest, GenerativeScoringResponse

router = APIRouter()


@router.post("/generative_scoring")
async def create_generative_scoring(
    request: GenerativeScoringRequest, serving: ScoringServingDep
) -> GenerativeScoringResponse:
    return await serving.create_generative_scoring(request)
