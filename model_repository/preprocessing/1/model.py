"""Triton glue for preprocessing (backend/preprocessing.py): TEXT_INPUT, MESSAGES or INPUT_IDS in,
INPUT_IDS and their TOKEN_BYTES out."""

import json

import triton_python_backend_utils as pb_utils

from backend.config import preprocessing_model_path
from backend.contract import (
    ADD_SPECIAL_TOKENS,
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


class TritonPythonModel:
    def initialize(self, args) -> None:
        model_config = json.loads(args["model_config"])
        self.preprocessor = Preprocessor(
            preprocessing_model_path(model_config, args["model_repository"])
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            add_special = _input(request, ADD_SPECIAL_TOKENS)
            try:
                ids, token_bytes = self.preprocessor.run(
                    _input(request, TEXT_INPUT),
                    _input(request, MESSAGES),
                    None if add_special is None else bool(add_special.reshape(-1)[0]),
                    _input(request, INPUT_IDS),
                )
            except InvalidInputError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            tensors = [pb_utils.Tensor(INPUT_IDS, ids), pb_utils.Tensor(TOKEN_BYTES, token_bytes)]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
