"""FastAPI dependencies: the objects the lifespan put on `app.state`.

Each is `async def`: FastAPI runs a plain `def` dependency in its thread pool, a hop to a worker
thread and back for every request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from adapter.chat.serving import OpenAIServingChat
from adapter.completions.serving import OpenAIServingCompletion
from adapter.engine_client import EngineClient
from adapter.models import OpenAIServingModels
from adapter.scoring.serving import OpenAIServingGenerativeScoring
from adapter.tokenize.serving import OpenAIServingTokenization


async def get_engine_client(request: Request) -> EngineClient:
    return request.app.state.engine


async def get_models(request: Request) -> OpenAIServingModels:
    return request.app.state.models


async def get_completion_serving(request: Request) -> OpenAIServingCompletion:
    return request.app.state.completion_serving


async def get_chat_serving(request: Request) -> OpenAIServingChat:
    return request.app.state.chat_serving


async def get_tokenization_serving(request: Request) -> OpenAIServingTokenization:
    return request.app.state.tokenization_serving


async def get_scoring_serving(request: Request) -> OpenAIServingGenerativeScoring:
    return request.app.state.scoring_serving


EngineClientDep = Annotated[EngineClient, Depends(get_engine_client)]
ModelsDep = Annotated[OpenAIServingModels, Depends(get_models)]
CompletionServingDep = Annotated[OpenAIServingCompletion, Depends(get_completion_serving)]
ChatServingDep = Annotated[OpenAIServingChat, Depends(get_chat_serving)]
TokenizationServingDep = Annotated[OpenAIServingTokenization, Depends(get_tokenization_serving)]
ScoringServingDep = Annotated[OpenAIServingGenerativeScoring, Depends(get_scoring_serving)]
