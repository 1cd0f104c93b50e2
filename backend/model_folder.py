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
    """The engine loads the model with `AutoModelForCausalLM`: an encoder-decoder (T5) or an
    encoder (BERT without its LM head) would fail there, after tritonserver started, or
    earlier on a config without a context length, with advice that cannot help."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{path} holds a {model_type!r} model, which has no causal-LM head in transformers "
            "(AutoModelForCausalLM): only decoder-only text generators are served"
        )
