"""What a model folder must hold to be served: a causal LM's config and a real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_path: str | Path) -> Any:
    """The folder's tokenizer. transformers 5 builds an empty one of a single token for some
    model types (Qwen2's) when the folder has no tokenizer files, instead of raising: every
    text would then be no tokens and every output no text, so it is refused."""
    from transformers import AutoTokenizer  # the engine's dependency: only where one is loaded

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if len(tokenizer) < 2:
        raise ValueError(
            f"{model_path} has no tokenizer (transformers built one of {len(tokenizer)} token): "
            "add the model's tokenizer files (tokenizer.json, tokenizer_config.json, ...)"
        )
    return tokenizer


def check_model_folder(model_path: str | Path) -> None:
    """Refuses, before any server starts, a path that is no model folder."""
    path = Path(model_path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
    _check_causal_lm(path)
    load_tokenizer(path)


def _check_causal_lm(path: Path) -> None:
    """The engine loads the model with `AutoModelForCausalLM`. A model type without such a
    class (T5) would fail there, after tritonserver started, or earlier on a config without a
    context length, with advice that cannot help; an encoder-decoder that has one (BART,
    Whisper) would load its decoder alone, without the encoder its outputs depend on."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{path} holds a {config.model_type!r} model, which has no causal-LM class in "
            "transformers (AutoModelForCausalLM): only decoder-only text generators are served"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{path} holds a {config.model_type!r} model, an encoder-decoder: only "
            "decoder-only text generators are served"
        )
