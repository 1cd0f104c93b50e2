"""write_repository / set_parameters: a served copy of the template with parameters replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import GPT2Config

from backend.repository import TEMPLATE, known_parameters, set_parameters, write_repository
from tests.backend.triton_config import config_parameters


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_set_parameters_replaces_only_the_named_values() -> None:
    text = (
        'name: "llm"\n'
        'parameters { key: "model_path" value: { string_value: "old" } }\n'
        'parameters { key: "max_num_seqs" value: { string_value: "16" } }\n'
    )
    result = set_parameters(text, {"max_num_seqs": "4", "not_there": "x"})
    assert result == text.replace('"16"', '"4"')
    assert set_parameters(text, {}) == text


def test_set_parameters_writes_values_literally() -> None:
    text = 'parameters { key: "model_path" value: { string_value: "old" } }'
    assert set_parameters(text, {"model_path": r"C:\models\1 \g<0>"}) == (
        r'parameters { key: "model_path" value: { string_value: "C:\models\1 \g<0>" } }'
    )


def test_write_repository_sets_values_in_every_model(tmp_path: Path) -> None:
    template_before = snapshot(TEMPLATE)
    model = tmp_path / "models" / "tiny"
    dest = write_repository(
        tmp_path / "repo", model, {"max_num_seqs": "3", "max_logprob_token_ids": "77"}
    )

    assert dest == tmp_path / "repo"
    llm = config_parameters("llm", dest)
    template_llm = config_parameters("llm", TEMPLATE)
    assert llm == {
        **template_llm,
        "model_path": str(model.resolve()),
        "max_num_seqs": "3",
        "max_logprob_token_ids": "77",
    }
    # The folder has no config.json: the context stays the template's (the model's own).
    assert config_parameters("preprocessing", dest) == {
        "model_path": str(model.resolve()),
        "max_model_len": "0",
    }
    # Everything but the parameter values is copied as is.
    copied = snapshot(dest)
    assert set(copied) == set(template_before)
    assert copied["llm/1/model.py"] == template_before["llm/1/model.py"]
    assert copied["ensemble/config.pbtxt"] == template_before["ensemble/config.pbtxt"]
    assert snapshot(TEMPLATE) == template_before


def test_write_repository_replaces_an_existing_destination(tmp_path: Path) -> None:
    dest = tmp_path / "repo"
    (dest / "stale").mkdir(parents=True)
    (dest / "stale" / "config.pbtxt").write_text("old")
    write_repository(dest, tmp_path / "m")
    assert not (dest / "stale").exists()
    assert (dest / "llm" / "config.pbtxt").exists()
    assert not list(dest.rglob("__pycache__"))


def test_a_relative_model_path_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    dest = write_repository(tmp_path / "repo", Path("rel/model"))
    assert config_parameters("llm", dest)["model_path"] == str(
        (tmp_path / "rel" / "model").resolve()
    )


def test_the_served_context_is_written_for_clients(tmp_path: Path) -> None:
    """The adapter reads `max_model_len` from the config: the context the engine will hold,
    whatever the model's config calls it (GPT-2: `n_positions`); `preprocessing` bounds a
    prompt's text by the same."""
    GPT2Config(n_positions=300).save_pretrained(tmp_path / "m")
    dest = write_repository(tmp_path / "repo", tmp_path / "m", {"max_model_len": "200"})
    assert config_parameters("llm", dest)["max_model_len"] == "200"
    assert config_parameters("preprocessing", dest)["max_model_len"] == "200"
    dest = write_repository(tmp_path / "repo", tmp_path / "m")
    assert config_parameters("llm", dest)["max_model_len"] == "300"
    assert config_parameters("preprocessing", dest)["max_model_len"] == "300"
    with pytest.raises(ValueError, match="max_model_len 301 is more than this model serves: 300"):
        write_repository(tmp_path / "repo", tmp_path / "m", {"max_model_len": "301"})


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"max_queue_size": "0"}, "max_queue_size must be >= 1, got 0"),
        ({"dtype": 'float32" } }'}, "llm parameter dtype: quotes, backslashes and newlines"),
    ],
)
def test_bad_values_are_refused_before_anything_is_written(
    tmp_path: Path, parameters: dict[str, str], message: str
) -> None:
    """The launcher's --set values fail here, at once, not in the model's load."""
    with pytest.raises(ValueError, match=message):
        write_repository(tmp_path / "repo", tmp_path / "m", parameters)
    assert not (tmp_path / "repo").exists()


def test_unknown_parameters_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown llm parameters: \['max_batch', 'zzz'\]"):
        write_repository(tmp_path / "repo", tmp_path / "m", {"max_batch": "1", "zzz": "2"})
    assert not (tmp_path / "repo").exists()


def test_known_parameters_are_the_templates() -> None:
    assert known_parameters("llm") == set(config_parameters("llm"))
    assert {"model_path", "max_num_seqs", "max_logprobs"} <= known_parameters("llm")
    assert known_parameters("preprocessing") == {"model_path", "max_model_len"}
