"""Triton glue for preprocessing (backend/preprocessing.py): TEXT_INPUT, MESSAGES or INPUT_IDS in,
INPUT_IDS and their TOKEN_BYTES out."""

import json

import triton_python_backend_utils as pb_utils

from backend.config import PreprocessingConfig
from backend.contract import (
    ADD_GENERATION_PROMPT,
    ADD_SPECIAL_TOKENS,
    CHAT_TEMPLATE_KWARGS,
    CONTINUE_FINAL_MESSAGE,
    INPUT_IDS,
    MESSAGES,
    TEXT_INPUT,
    TOKEN_BYTES,
)
from backend.params import InvalidInputError
from backend.preprocessing import Preprocessor


def _input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _flag(request, name: str) -> bool | None:
    value = _input(request, name)
    return None if value is None else bool(value.reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args) -> None:
        model_config = json.loads(args["model_config"])
        config = PreprocessingConfig.from_model_config(model_config, args["model_repository"])
        self.preprocessor = Preprocessor(config.model_path, config.max_model_len)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids, token_bytes = self.preprocessor.run(
                    _input(request, TEXT_INPUT),
                    _input(request, MESSAGES),
                    _flag(request, ADD_SPECIAL_TOKENS),
                    _input(request, INPUT_IDS),
                    add_generation_prompt=_flag(request, ADD_GENERATION_PROMPT),
                    continue_final_message=_flag(request, CONTINUE_FINAL_MESSAGE),
                    chat_template_kwargs=_input(request, CHAT_TEMPLATE_KWARGS),
                )
            except InvalidInputError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            except Exception as exc:  # a bug: this request's error, not the whole batch's
                pb_utils.Logger.log_error(f"preprocessing: {type(exc).__name__}: {exc}")
                error = pb_utils.TritonError(
                    f"internal error: {exc}", pb_utils.TritonError.INTERNAL
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            tensors = [pb_utils.Tensor(INPUT_IDS, ids), pb_utils.Tensor(TOKEN_BYTES, token_bytes)]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
