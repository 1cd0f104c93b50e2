"""The config.pbtxt files agree with each other and with the tensor names in triton_io."""

from __future__ import annotations

import re

from backend import triton_io
from backend.repository import TEMPLATE

_TENSOR = re.compile(r'\{ name: "(\w+)", data_type: (\w+), dims: \[ ([-\d, ]+) \]')


def _tensors(model: str) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    text = (TEMPLATE / model / "config.pbtxt").read_text()
    inputs, _, rest = text.partition("output [")
    outputs = rest.split("]\n\n")[0]
    return _parse(inputs), _parse(outputs)


def _parse(part: str) -> dict[str, tuple[str, str]]:
    return {name: (dtype, dims) for name, dtype, dims in _TENSOR.findall(part)}


def test_ensemble_mirrors_llm():
    llm_in, llm_out = _tensors("llm")
    ens_in, ens_out = _tensors("ensemble")
    assert ens_out == llm_out
    assert {k: v for k, v in ens_in.items() if k in llm_in} == {
        k: v for k, v in llm_in.items() if k != triton_io.INPUT_IDS
    }
    pre_in, pre_out = _tensors("preprocessing")
    # The ensemble takes text or chat; token ids go to llm (or preprocessing, to detokenize).
    assert set(ens_in) == (set(llm_in) | set(pre_in)) - {triton_io.INPUT_IDS}
    assert set(pre_out) == {triton_io.INPUT_IDS, triton_io.TOKEN_BYTES}
    text = (TEMPLATE / "ensemble" / "config.pbtxt").read_text()
    for name in set(ens_in) | set(ens_out):
        assert f'key: "{name}" value: "{name}"' in text, f"{name} is not mapped to its step"


def test_every_configured_tensor_has_a_name_constant():
    names = {v for k, v in vars(triton_io).items() if k.isupper() and isinstance(v, str)}
    for model in ("llm", "ensemble", "preprocessing"):
        inputs, outputs = _tensors(model)
        assert set(inputs) | set(outputs) <= names
