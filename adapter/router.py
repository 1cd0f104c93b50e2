"""GET /health, /health/ready, /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter

from adapter.deps import EngineClientDep, ModelsDep
from adapter.errors import EngineUnavailableError, error_responses
from adapter.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The adapter process answers; says nothing about Triton."""
    return {"status": "ok"}


@router.get("/health/ready", responses=error_responses(500, 503))
async def ready(engine: EngineClientDep) -> dict[str, str]:
    """Triton and both models are ready (503 otherwise); also caches the model's limits.

    While the adapter drains after SIGTERM the middleware answers 503 before this runs."""
    if not await engine.is_ready():
        raise EngineUnavailableError("Triton or its models are not ready.")
    await engine.model_info()
    return {"status": "ready"}


@router.get("/v1/models", responses=error_responses(401, 500, 503))
async def list_models(models: ModelsDep) -> ModelList:
    return await models.list_models()


@router.get("/v1/models/{model_id:path}", responses=error_responses(401, 404, 500, 503))
async def retrieve_model(model_id: str, models: ModelsDep) -> ModelCard:
    return await models.model_card(model_id)
