"""Reference computations: the served model through plain transformers (float64 logprobs)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


@cache
def _model(model_dir: str, dtype: torch.dtype, device: str = "cpu") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper hides Module.to
    return model.eval()


@cache
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@torch.inference_mode()
def reference_logprobs(model_dir: Path, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """[len(output_ids), V] float64 log-softmax of the raw logits at each generated position."""
    model = _model(str(model_dir), torch.float64)
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).numpy()


@torch.inference_mode()
def reference_greedy(
    model_dir: Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[int]:
    """transformers' own `generate` (greedy; by default float32 as served on CPU)."""
    model = _model(str(model_dir), dtype, device)
    ids = torch.tensor([list(prompt_ids)], device=device)
    # PreTrainedModel's stubs type `generate` as a tensor attribute (GenerationMixin is mixed in
    # per model class).
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)  # type: ignore[operator]
    return out[0, len(prompt_ids) :].tolist()
