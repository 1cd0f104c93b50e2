"""Triton glue for preprocessing (backend/preprocessing.py): TEXT_INPUT, MESSAGES or INPUT_IDS in,
INPUT_IDS and their TOKEN_BYTES out."""

import json

import triton_python_backend_utils as pb_utils

from backend.config import PreprocessingConfig
from backend.contract import INPUT_IDS, MODELS, TOKEN_BYTES
from backend.params import InvalidInputError
from backend.preprocessing import Preprocessor

INPUTS = tuple(MODELS["preprocessing"].inputs)


def _inputs(request) -> dict:
    """The request's input arrays by name; absent ones left out."""
    tensors = {name: pb_utils.get_input_tensor_by_name(request, name) for name in INPUTS}
    return {name: tensor.as_numpy() for name, tensor in tensors.items() if tensor is not None}


class TritonPythonModel:
    def initialize(self, args) -> None:
        model_config = json.loads(args["model_config"])
        config = PreprocessingConfig.from_model_config(model_config, args["model_repository"])
        self.preprocessor = Preprocessor(config.model_path, config.max_model_len)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids, token_bytes = self.preprocessor.run_inputs(_inputs(request))
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
