"""The served model's name and cards (/v1/models), and the check of a request's `model`."""

from __future__ import annotations

from adapter.engine_client import EngineClient, ModelInfo
from adapter.errors import ModelNotFoundError
from adapter.protocol import ModelCard, ModelList


class OpenAIServingModels:
    """Resolves the served name: the configured one, else the model folder's name from Triton."""

    def __init__(self, engine: EngineClient, served_model_name: str | None) -> None:
        self._engine = engine
        self._configured_name = served_model_name

    async def resolve(self, requested: str | None) -> tuple[str, ModelInfo]:
        """The served name and the model's limits; 404 when `requested` names another model."""
        if self._configured_name is not None and requested not in (None, self._configured_name):
            raise ModelNotFoundError(requested)
        info = await self._engine.model_info()
        name = self._configured_name or info.default_model_name
        if requested is not None and requested != name:
            raise ModelNotFoundError(requested)
        return name, info

    async def list_models(self) -> ModelList:
        return ModelList(data=[await self.model_card(None)])

    async def model_card(self, model_id: str | None) -> ModelCard:
        name, info = await self.resolve(model_id)
        return ModelCard(id=name, root=info.model_path, max_model_len=info.max_model_len)
