"""backend/contract.py against what Triton loads (every config.pbtxt) and what users read
(docs/tensors.md): a tensor added, renamed or retyped in one place fails here."""

from __future__ import annotations

import re

import pytest

from backend import contract
from backend.default_model import REPO_ROOT
from tests.backend.triton_config import config_parameters, config_tensor_entries

DOCS = (REPO_ROOT / "docs" / "tensors.md").read_text()
WIRE_TYPES = {"TYPE_STRING": "BYTES"}


@pytest.mark.parametrize("model", sorted(contract.MODELS))
def test_each_config_pbtxt_declares_the_contracts_tensors(model: str) -> None:
    expected = contract.MODELS[model]
    inputs = config_tensor_entries(model, "input")
    outputs = config_tensor_entries(model, "output")
    assert {name: entry.optional for name, entry in inputs.items()} == dict(expected.inputs)
    assert set(outputs) == expected.outputs
    for name, entry in {**inputs, **outputs}.items():
        tensor = contract.TENSORS[name]
        assert (entry.data_type, entry.dims) == (tensor.data_type, tensor.dims), name


def _documented(section: str) -> dict[str, str]:
    """Tensor name -> its "type, shape" cell in a docs/tensors.md table."""
    body = DOCS.split(section, 1)[1].split("\n\n", 2)[1]
    found = {}
    for line in body.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            found[name] = cells[1]
    return found


def test_docs_tensors_md_lists_every_tensor_with_its_type_and_rank() -> None:
    documented = {**_documented("### Inputs"), **_documented("### Outputs")}
    served = {name for model in ("llm", "ensemble") for name in contract.MODELS[model].inputs}
    assert set(documented) == served | contract.MODELS["llm"].outputs
    for name, cell in documented.items():
        tensor = contract.TENSORS[name]
        wire_type = WIRE_TYPES.get(tensor.data_type, tensor.data_type.removeprefix("TYPE_"))
        shapes = re.findall(r"`\[([^\]]*)\]`", cell)
        assert shapes and all(len(shape.split(",")) == len(tensor.dims) for shape in shapes), name
        types = re.findall(r"\b(BYTES|BOOL|INT32|INT64|FP32)\b", cell)
        assert not types or wire_type in types, (name, cell)


def test_the_limits_are_config_pbtxts_defaults() -> None:
    parameters = config_parameters("llm")
    assert int(parameters["max_logprobs"]) == contract.DEFAULT_MAX_LOGPROBS
    assert int(parameters["max_logprob_token_ids"]) == contract.DEFAULT_MAX_LOGPROB_TOKEN_IDS
    assert contract.DEFAULT_MAX_LOGPROBS <= contract.MAX_TOP_K
