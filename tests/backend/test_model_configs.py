"""The ensemble's steps map each of its tensors to the composing model's tensor of the same name
(tests/backend/test_contract.py holds every config.pbtxt against backend/contract.py)."""

from __future__ import annotations

from backend import contract
from backend.repository import TEMPLATE


def test_the_ensemble_maps_every_tensor_to_its_step() -> None:
    text = (TEMPLATE / "ensemble" / "config.pbtxt").read_text()
    ensemble = contract.MODELS["ensemble"]
    for name in {*ensemble.inputs, *ensemble.outputs}:
        assert f'key: "{name}" value: "{name}"' in text, f"{name} is not mapped to its step"


def test_the_ensemble_takes_text_or_chat_and_llm_takes_ids() -> None:
    llm, ensemble = contract.MODELS["llm"], contract.MODELS["ensemble"]
    preprocessing = contract.MODELS["preprocessing"]
    assert ensemble.outputs == llm.outputs
    # CANCEL is llm's alone: through the ensemble it would reach preprocessing first.
    assert set(ensemble.inputs) == (set(llm.inputs) | set(preprocessing.inputs)) - {
        contract.INPUT_IDS,
        contract.CANCEL,
    }
    assert preprocessing.outputs == {contract.INPUT_IDS, contract.TOKEN_BYTES}
