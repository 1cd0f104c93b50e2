"""Runs the Hugging Face causal LM: prefill a prompt, decode one token for many sequences."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: generation_config's list (chat models have several)."""
    ids: set[int] = set()
    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        configured = None
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


class ModelRunner:
    """One KV cache per sequence (transformers' DynamicCache); decode runs them one by one."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_ids = eos_token_ids(model_path, self.tokenizer)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[Any, torch.Tensor]:
        """(the sequence's cache, logits [V] for the next token)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, caches: list[Any], tokens: list[int]) -> torch.Tensor:
        """Append one token to each sequence; logits [B, V] for the next one."""
        rows = []
        for cache, token in zip(caches, tokens, strict=True):
            ids = torch.tensor([[token]], device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1])
        return torch.stack(rows)
