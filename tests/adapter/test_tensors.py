"""Params -> input arrays / InferInputs, and response arrays -> TritonOutput."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adapter.errors import EngineError, InvalidRequestError
from adapter.logprobs import LogprobsCollector
from adapter.tensors import (
    TritonOutput,
    TritonRequest,
    llm_inputs,
    preprocessing_inputs,
    to_infer_inputs,
)
from backend import contract
from tests.adapter.fakes import response_arrays
from tests.backend.triton_config import config_tensors


def test_llm_inputs_with_every_option() -> None:
    params = TritonRequest(
        text="ignored here",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=2**40,
        stop=("\n", "END"),
        stop_token_ids=(2, 3),
        include_stop_str_in_output=True,
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        logit_bias=((7, 100.0), (8, -2.5)),
        allowed_token_ids=(7, 8, 9),
        logprobs=4,
        logprob_token_ids=(10, 11),
        prompt_logprobs=2,
        prompt_logprob_token_ids=(12,),
    )
    arrays = llm_inputs(params, np.array([5, 6], dtype=np.int32))
    expected = {
        contract.INPUT_IDS: (np.int32, [5, 6]),
        contract.MAX_TOKENS: (np.int32, [7]),
        contract.TEMPERATURE: (np.float32, [0.5]),
        contract.TOP_P: (np.float32, [np.float32(0.9)]),
        contract.TOP_K: (np.int32, [3]),
        contract.SEED: (np.int64, [2**40]),
        contract.STOP: (np.object_, [b"\n", b"END"]),
        contract.STOP_TOKEN_IDS: (np.int32, [2, 3]),
        contract.INCLUDE_STOP_STR_IN_OUTPUT: (np.bool_, [True]),
        contract.IGNORE_EOS: (np.bool_, [True]),
        contract.MIN_TOKENS: (np.int32, [2]),
        contract.PRESENCE_PENALTY: (np.float32, [0.5]),
        contract.FREQUENCY_PENALTY: (np.float32, [-0.25]),
        contract.REPETITION_PENALTY: (np.float32, [1.5]),
        contract.LOGIT_BIAS_IDS: (np.int32, [7, 8]),
        contract.LOGIT_BIAS_VALUES: (np.float32, [100.0, -2.5]),
        contract.ALLOWED_TOKEN_IDS: (np.int32, [7, 8, 9]),
        contract.LOGPROBS: (np.int32, [4]),
        contract.LOGPROB_TOKEN_IDS: (np.int32, [10, 11]),
        contract.PROMPT_LOGPROBS: (np.int32, [2]),
        contract.PROMPT_LOGPROB_TOKEN_IDS: (np.int32, [12]),
    }
    assert arrays.keys() == expected.keys()
    for name, (dtype, values) in expected.items():
        assert arrays[name].dtype == dtype, name
        assert arrays[name].tolist() == values, name


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "parameter", "max_model_len", "refused"),
    [
        (5, 59, "max_tokens", 64, False),  # exactly the context
        (5, 60, "max_tokens", 64, True),
        (5, 60, "max_completion_tokens", 64, True),
        (5, 60, None, 64, False),  # the server's default: the model stops at the context's end
        (64, 1, "max_tokens", 64, False),  # the prompt alone: the model's error, naming it
        (5, 60, "max_tokens", None, False),  # the context is not known
    ],
)
def test_check_fits_context(
    prompt_tokens: int,
    max_tokens: int,
    parameter: str | None,
    max_model_len: int | None,
    refused: bool,
) -> None:
    params = TritonRequest(prompt_ids=(1,), max_tokens=max_tokens, max_tokens_parameter=parameter)
    if not refused:
        params.check_fits_context(prompt_tokens, max_model_len)
        return
    with pytest.raises(InvalidRequestError) as raised:
        params.check_fits_context(prompt_tokens, max_model_len)
    assert raised.value.parameter == parameter
    assert str(raised.value).startswith(f"`{parameter}` is too large: {max_tokens}.")


def test_defaults_are_left_to_the_model() -> None:
    assert llm_inputs(TritonRequest(prompt_ids=(1, 2)), (1, 2)).keys() == {contract.INPUT_IDS}
    arrays = llm_inputs(TritonRequest(prompt_ids=(1,), logprobs=0), (1,))
    assert arrays[contract.LOGPROBS].tolist() == [0]  # 0 still asks for the sampled token's logprob


def test_preprocessing_inputs_for_text_and_messages() -> None:
    text = preprocessing_inputs(TritonRequest(text="Grüße", add_special_tokens=False))
    assert text[contract.TEXT_INPUT].tolist() == ["Grüße".encode()]
    assert text[contract.ADD_SPECIAL_TOKENS].dtype == np.bool_
    assert text[contract.ADD_SPECIAL_TOKENS].tolist() == [False]

    messages = ({"role": "user", "content": "¿Qué?"},)
    chat = preprocessing_inputs(TritonRequest(messages=messages))
    assert chat.keys() == {contract.MESSAGES}
    assert chat[contract.MESSAGES].shape == (1,)
    assert json.loads(chat[contract.MESSAGES][0].decode()) == [{"role": "user", "content": "¿Qué?"}]

    continued = preprocessing_inputs(
        TritonRequest(messages=messages, add_generation_prompt=False, continue_final_message=True)
    )
    flags = [contract.ADD_GENERATION_PROMPT, contract.CONTINUE_FINAL_MESSAGE]
    assert [continued[name].dtype for name in flags] == [np.bool_, np.bool_]
    assert [continued[name].tolist() for name in flags] == [[False], [True]]

    kwargs = {"enable_thinking": False, "note": "é"}
    thinking = preprocessing_inputs(TritonRequest(messages=messages, chat_template_kwargs=kwargs))
    assert json.loads(thinking[contract.CHAT_TEMPLATE_KWARGS][0].decode()) == kwargs


@pytest.mark.parametrize(
    "params",
    [
        TritonRequest(prompt_ids=(1,)),
        TritonRequest(text="a", messages=({"role": "user", "content": "b"},)),
    ],
)
def test_preprocessing_needs_exactly_one_text_prompt(params: TritonRequest) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        preprocessing_inputs(params)


def test_infer_inputs_carry_triton_dtypes() -> None:
    params = TritonRequest(seed=1, temperature=0.0, ignore_eos=False, logprob_token_ids=(4,))
    arrays = {**preprocessing_inputs(TritonRequest(text="x")), **llm_inputs(params, (1,))}
    inputs = {i.name(): i for i in to_infer_inputs(arrays)}
    assert {name: i.datatype() for name, i in inputs.items()} == {
        contract.TEXT_INPUT: "BYTES",
        contract.INPUT_IDS: "INT32",
        contract.SEED: "INT64",
        contract.TEMPERATURE: "FP32",
        contract.IGNORE_EOS: "BOOL",
        contract.LOGPROB_TOKEN_IDS: "INT32",
    }
    assert inputs[contract.LOGPROB_TOKEN_IDS].shape() == [1]


def test_output_from_arrays() -> None:
    arrays = response_arrays(
        [(5, b"\xe2\x82", -0.25), (6, b"\xac", -1.5)],
        text="€",
        top=[[(5, b"\xe2\x82", -0.25), (9, b"x", -2.0)], [(6, b"\xac", -1.5), (1, b"", -3.0)]],
        requested=[[-4.0], [-9999.0]],
        requested_bytes=[b"q"],
        finish_reason="stop",
        prompt_tokens=4,
        completion_tokens=2,
    )
    out = TritonOutput.from_arrays(arrays, final=True)
    assert out.output_ids == [5, 6]
    assert out.text == "€"
    assert out.token_bytes == [b"\xe2\x82", b"\xac"]
    assert out.logprobs == [-0.25, -1.5]
    assert out.top_ids == [[5, 9], [6, 1]]
    assert out.top_logprobs == [[-0.25, -2.0], [-1.5, -3.0]]
    assert out.top_token_bytes == [[b"\xe2\x82", b"x"], [b"\xac", b""]]
    assert out.requested_logprobs == [[-4.0], [-9999.0]]
    assert out.requested_token_bytes == [b"q"]
    assert (out.finish_reason, out.prompt_tokens, out.completion_tokens, out.final) == (
        "stop",
        4,
        2,
        True,
    )


def test_output_with_prompt_logprobs() -> None:
    arrays = response_arrays(
        prompt=[(3, b"<s>", 0.0), (4, b"a", -1.5), (5, b"\xe2", -0.5)],
        prompt_top=[[(4, b"a", -1.5)], [(6, b"b", -0.25)]],
        prompt_requested=[[-2.0, -3.0], [-4.0, -9999.0]],
        prompt_requested_bytes=[b"x", b"y"],
    )
    prompt = TritonOutput.from_arrays(arrays, final=False).prompt
    assert prompt is not None
    assert (prompt.ids, prompt.token_bytes) == ([3, 4, 5], [b"<s>", b"a", b"\xe2"])
    assert prompt.logprobs == [-1.5, -0.5]  # one row fewer: the first token has none
    assert (prompt.top_ids, prompt.top_logprobs) == ([[4], [6]], [[-1.5], [-0.25]])
    assert prompt.top_token_bytes == [[b"a"], [b"b"]]
    assert prompt.requested_logprobs == [[-2.0, -3.0], [-4.0, -9999.0]]
    assert prompt.requested_token_bytes == [b"x", b"y"]
    assert TritonOutput.from_arrays(response_arrays(), final=False).prompt is None


def test_a_sampled_only_response_reads_as_an_empty_top_k_per_token() -> None:
    """LOGPROBS=0 does not ask for the top-k tensors; each token then has no alternative, as
    with the [n, 0] tensors the model would send, and a requested one that is absent is an
    error, not an empty top-k."""
    names = TritonRequest(prompt_ids=(1,), logprobs=0).output_names
    sent = response_arrays([(5, b"a", -0.25), (6, b"b", -1.5)])
    out = TritonOutput.from_arrays({name: sent[name] for name in names}, final=False)
    assert (out.logprobs, out.top_ids, out.top_logprobs) == ([-0.25, -1.5], [[], []], [[], []])
    positions = LogprobsCollector(()).positions(out)
    assert [(p.sampled.token_id, p.alternatives) for p in positions] == [(5, ()), (6, ())]
    lost = {**sent, contract.TOP_LOGPROBS: None}
    with pytest.raises(EngineError, match="2 tokens but 0 logprob rows"):
        LogprobsCollector(()).positions(TritonOutput.from_arrays(lost, final=False))


def test_output_not_final_and_empty() -> None:
    out = TritonOutput.from_arrays(response_arrays([], text="", logprobs=False), final=False)
    assert (out.output_ids, out.text, out.logprobs, out.top_ids) == ([], "", [], [])
    assert out.finish_reason is None  # "" until the final response
    missing = TritonOutput.from_arrays({}, final=False)
    assert (missing.output_ids, missing.text, missing.prompt_tokens) == ([], "", 0)


@pytest.mark.parametrize(
    ("fields", "groups"),
    [
        ({}, ()),
        ({"logprobs": 0}, ("sampled",)),
        ({"logprobs": 3}, ("sampled", "top")),
        ({"logprobs": 0, "logprob_token_ids": (5,)}, ("sampled", "ids")),
        ({"logprob_token_ids": (5,)}, ("sampled", "ids")),
        ({"prompt_logprobs": 1}, ("prompt",)),
        ({"logprobs": 2, "prompt_logprob_token_ids": (4,)}, ("sampled", "top", "prompt")),
        ({"stop": ("\n",)}, ("stop",)),
        ({"stop_token_ids": (7,), "logprobs": 0}, ("stop", "sampled")),
    ],
)
def test_a_request_asks_only_for_the_outputs_it_reads(
    fields: dict[str, object], groups: tuple[str, ...]
) -> None:
    names = TritonRequest(prompt_ids=(1,), **fields).output_names  # type: ignore[arg-type]
    outputs_of = {
        "sampled": contract.SAMPLED_LOGPROB_OUTPUTS,
        "top": contract.TOP_LOGPROB_OUTPUTS,
        "ids": contract.TOKEN_ID_LOGPROB_OUTPUTS,
        "prompt": contract.PROMPT_OUTPUTS,
        "stop": (contract.STOP_REASON,),
    }
    expected = set(contract.ALWAYS_OUTPUTS).union(*(outputs_of[group] for group in groups))
    assert set(names) == expected


def test_the_output_groups_cover_the_llm_outputs_once() -> None:
    assert len(contract.LLM_OUTPUTS) == len(set(contract.LLM_OUTPUTS))
    assert set(contract.LLM_OUTPUTS) == set(config_tensors("llm", "output"))
