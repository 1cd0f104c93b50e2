"""LLMConfig.from_model_config: config.pbtxt parameters, typed, with their defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backend.config import LLMConfig, PreprocessingConfig, resolve_model_path


def model_config(**parameters: str) -> dict[str, Any]:
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_a_relative_model_path_is_relative_to_the_repository_folder(tmp_path: Path) -> None:
    model_folder = tmp_path / "serving" / "model_repository" / "llm"  # args["model_repository"]
    config = LLMConfig.from_model_config(
        model_config(model_path="../models/tiny"), str(model_folder)
    )
    assert config.model_path == str((tmp_path / "serving" / "models" / "tiny").resolve())
    assert (
        PreprocessingConfig.from_model_config(
            model_config(model_path="../models/tiny"),
            str(tmp_path / "serving" / "model_repository" / "preprocessing"),
        ).model_path
        == config.model_path
    )


def test_the_templates_default_points_beside_the_repository(tmp_path: Path) -> None:
    folder = tmp_path / "repo" / "model_repository" / "llm"
    resolved = resolve_model_path("../.cache/models/default", str(folder))
    assert resolved == str((tmp_path / "repo" / ".cache" / "models" / "default").resolve())


def test_an_absolute_model_path_is_kept(tmp_path: Path) -> None:
    absolute = str(tmp_path / "elsewhere" / "model")
    config = LLMConfig.from_model_config(model_config(model_path=absolute), "/any/repo/llm")
    assert config.model_path == absolute


def test_absent_or_empty_parameters_take_the_defaults() -> None:
    config = LLMConfig.from_model_config(
        model_config(model_path="/m", device="", dtype=""), "/r/llm"
    )
    assert config == LLMConfig(model_path="/m")
    assert (config.device, config.dtype, config.max_model_len) == ("auto", "auto", 0)
    assert (config.max_num_seqs, config.max_logprobs, config.max_logprob_token_ids) == (
        16,
        20,
        1024,
    )


def test_every_parameter_is_parsed() -> None:
    config = LLMConfig.from_model_config(
        model_config(
            model_path="/m",
            device="cpu",
            dtype="float32",
            max_model_len="256",
            max_num_seqs="8",
            kv_cache_memory_mb="12",
            max_queue_size="3",
            max_logprobs="5",
            max_logprob_token_ids="64",
            fast_decode="false",
        ),
        "/r/llm",
    )
    assert config == LLMConfig(
        model_path="/m",
        device="cpu",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_mb=12,
        max_queue_size=3,
        max_logprobs=5,
        max_logprob_token_ids=64,
        fast_decode=False,
    )


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"max_num_seqs": "abc"},
            "config.pbtxt parameter `max_num_seqs` must be an integer, got 'abc'",
        ),
        ({"max_num_seqs": "0"}, "max_num_seqs must be >= 1, got 0"),
        ({"max_queue_size": "0"}, "max_queue_size must be >= 1, got 0"),
        ({"max_model_len": "-5"}, "max_model_len must be >= 0, got -5"),
        ({"kv_cache_memory_mb": "-1"}, "kv_cache_memory_mb must be >= 0, got -1"),
        ({"num_threads": "-1"}, "num_threads must be >= 0, got -1"),
        ({"dtype": "bogus"}, "dtype must be one of ['auto', 'float32', 'bfloat16', 'float16']"),
        ({"device": "gpu"}, "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        ({"max_logprobs": "100"}, "max_logprobs must be in [0, 20], got 100"),
    ],
)
def test_bad_values_are_refused_naming_the_parameter(
    parameters: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        LLMConfig.from_model_config(model_config(model_path="/m", **parameters), "/r/llm")
    assert str(info.value).startswith(message)


def test_fast_decode_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="fast_decode"):
        LLMConfig.from_model_config(model_config(model_path="/m", fast_decode="fast"), "/r/llm")


@pytest.mark.parametrize("config", [{}, {"parameters": {}}, model_config(model_path="")])
def test_model_path_is_required(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="model_path"):
        LLMConfig.from_model_config(config, "/r/llm")
    with pytest.raises(ValueError, match="model_path"):
        PreprocessingConfig.from_model_config(config, "/r/preprocessing")


@pytest.mark.parametrize(("value", "message"), [("-1", "must be >= 0"), ("8k", "an integer")])
def test_preprocessing_s_max_model_len_is_checked(value: str, message: str) -> None:
    config = model_config(model_path="/m", max_model_len=value)
    with pytest.raises(ValueError, match=message):
        PreprocessingConfig.from_model_config(config, "/r/preprocessing")
    config = model_config(model_path="/m", max_model_len="300")
    assert PreprocessingConfig.from_model_config(config, "/r/preprocessing").max_model_len == 300
