"""Text and chat prompts tokenized in the adapter's own process, by the code of the
`preprocessing` model (`backend.preprocessing.Preprocessor`) on the `llm` model's folder, where
this host can read it: a Triton round trip less per request (docs/design.md, "Tokenizing in the
adapter"). Elsewhere, such as the adapter's image without `transformers`, `preprocessing` does
it as before."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from adapter.engine_client import EngineClient, ModelInfo
from adapter.errors import TritonInputError
from adapter.tensors import TritonOutput, TritonRequest, preprocessing_inputs
from backend import contract
from backend.params import InvalidInputError

if TYPE_CHECKING:  # the adapter's image has no `transformers`: imported when loading
    from backend.preprocessing import Preprocessor

logger = logging.getLogger(__name__)


def load_preprocessor(info: ModelInfo) -> Preprocessor | None:
    """The `llm` model's tokenizer and chat template, as `preprocessing` loads them; None where
    this host cannot (no such folder, no `transformers`, a folder it cannot read), or where the
    path is relative: Triton reads it from its model repository, which the adapter does not
    know."""
    path = None if info.model_path is None else Path(info.model_path)
    if path is None or not path.is_absolute() or not path.is_dir():
        logger.info(
            "prompts are tokenized by Triton: %s is no model folder here (a relative path is "
            "in Triton's model repository)",
            info.model_path,
        )
        return None
    try:
        from backend.preprocessing import Preprocessor

        preprocessor = Preprocessor(str(path), info.max_model_len or 0)
    except Exception as exc:  # ImportError, OSError, a tokenizer transformers cannot load
        logger.warning("prompts are tokenized by Triton: cannot load %s: %s", path, exc)
        return None
    logger.info("prompts are tokenized in the adapter, with %s", path)
    return preprocessor


class LocalPreprocessing:
    """An `EngineClient` that tokenizes (and gives token bytes) itself, once its preprocessor
    has loaded, and passes everything else to `engine`. Errors are those of `preprocessing`:
    the same `TritonInputError`, so a refused prompt gets the same 400."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._loading: asyncio.Future[Preprocessor | None] | None = None

    async def _preprocessor(self) -> Preprocessor | None:
        """Loaded once, in a thread, on first use (the model's folder comes from Triton)."""
        if self._loading is None:
            info = await self._engine.model_info()  # raises while Triton is unreachable
            if self._loading is None:
                self._loading = asyncio.ensure_future(asyncio.to_thread(load_preprocessor, info))
        return await asyncio.shield(self._loading)

    @staticmethod
    async def _run(
        preprocessor: Preprocessor, inputs: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """In a thread: a long prompt takes milliseconds, which would hold every stream."""
        try:
            return await asyncio.to_thread(preprocessor.run_inputs, inputs)
        except InvalidInputError as exc:
            raise TritonInputError(exc.parameter, exc.detail) from exc

    async def is_ready(self) -> bool:
        """Once Triton is ready, also once the tokenizer has loaded (or is known not to be
        here): with `transformers` and torch in the adapter's environment, that takes seconds,
        which the first requests would otherwise wait."""
        if not await self._engine.is_ready():
            return False
        await self._preprocessor()
        return True

    async def model_info(self) -> ModelInfo:
        return await self._engine.model_info()

    async def tokenize(self, params: TritonRequest, request_id: str) -> list[int]:
        preprocessor = await self._preprocessor()
        if preprocessor is None:
            return await self._engine.tokenize(params, request_id)
        return await self._ids(preprocessor, params)

    async def _ids(self, preprocessor: Preprocessor, params: TritonRequest) -> list[int]:
        ids, _ = await self._run(preprocessor, preprocessing_inputs(params))
        return ids.tolist()

    async def token_bytes(self, ids: Sequence[int], request_id: str) -> list[bytes]:
        preprocessor = await self._preprocessor()
        if preprocessor is None:
            return await self._engine.token_bytes(ids, request_id)
        inputs = {contract.INPUT_IDS: np.asarray(ids, dtype=np.int32)}
        _, token_bytes = await self._run(preprocessor, inputs)
        return token_bytes.tolist()

    async def generate(
        self, params: TritonRequest, request_id: str
    ) -> AsyncGenerator[TritonOutput, None]:
        if params.needs_tokenizing and (preprocessor := await self._preprocessor()) is not None:
            params = replace(params, prompt_ids=tuple(await self._ids(preprocessor, params)))
        async with aclosing(self._engine.generate(params, request_id)) as stream:
            async for output in stream:
                yield output

    async def close(self) -> None:
        await self._engine.close()
