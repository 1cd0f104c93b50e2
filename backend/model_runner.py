"""Runs the Hugging Face causal LM: prefill one prompt, or decode one token for every sequence."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from backend.contract import DEFAULT_MAX_NUM_SEQS
from backend.fast_decode import FastDecoder, unsupported_reason
from backend.kv_cache import SlotKVCache, bytes_per_slot

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


def column_major_lm_head(model: Any) -> None:
    """Stores the output projection's weight [V, H] column-major (as its transpose's storage).

    Why: `F.linear(x, W)` computes `x @ W.T`; on CPU, with W row-major, MKL took 3.7-4.7 ms for
    16 rows of the default model (H 128, V 32000) and 1.8-2.5 ms for one row, against 2.9-3.3 ms
    and 0.35 ms with W.T contiguous, bitwise equal at 16 rows (docs/design.md, "The engine
    step"). The lm_head is the largest matrix a small model reads per step. A tied input
    embedding keeps its row-major copy, so the untied copy costs V x H more memory.
    """
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.stride(0) == 1:
        return  # no plain output projection, or already column-major
    head.weight = torch.nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)


class ModelRunner:
    """The model and its slot KV cache; rows of a decode batch are slots 0..B-1 (kv_cache.py)."""

    def __init__(
        self,
        model_path: str,
        device: str = "auto",
        dtype: str = "auto",
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int = 0,
        kv_cache_bytes: int = 0,
        fast_decode: bool = True,
    ) -> None:
        """`max_model_len` 0 = the model's context; `kv_cache_bytes` 0 = room for every slot;
        `fast_decode`: decode and prefill through `FastDecoder` when the model qualifies."""
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' wrapper hides Module.to
        if self.device.type == "cpu":
            column_major_lm_head(self.model)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.eos_ids = eos_token_ids(model_path, self.tokenizer)
        context = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.max_model_len = min(n for n in (max_model_len, context) if n > 0)
        per_slot = bytes_per_slot(config, self.max_model_len, self.dtype)
        slots = max_num_seqs
        if kv_cache_bytes > 0:
            slots = min(slots, kv_cache_bytes // per_slot)
        if slots < 1:
            raise ValueError(
                f"a KV cache of {kv_cache_bytes} bytes holds no sequence of {self.max_model_len} "
                f"tokens ({per_slot} bytes each): raise it or lower max_model_len"
            )
        self.cache = SlotKVCache(config, slots, self.max_model_len, self.device, self.dtype)
        # The keyword the model takes its cache by: `cache` in transformers 5.24 (the pin, which
        # still maps `past_key_values` to it, with a warning), `past_key_values` in 5.17 (the GPU
        # image's, which would silently ignore `cache`; docs/design.md, "The prepared GPU check").
        forward = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._mask_min = torch.finfo(self.dtype).min
        self.fast_decode_off_reason = (
            unsupported_reason(self.model) if fast_decode else "fast_decode is off"
        )
        self._fast = None if self.fast_decode_off_reason else FastDecoder(self.model, self.cache)

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @torch.inference_mode()
    def prefill(
        self, slot: int, prompt_ids: list[int], all_positions: bool = False
    ) -> torch.Tensor:
        """Fill `slot` with the prompt's keys and values. Logits [P, V] of every position when
        `all_positions` (prompt logprobs), else [1, V]; the last row is for the next token."""
        length = len(prompt_ids)
        ids = torch.tensor([prompt_ids], device=self.device)
        self.cache.plan_prefill(slot, length)
        if self._fast is not None:
            return self._fast.prefill(ids[0], all_positions)
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
        mask = torch.zeros(1, 1, length, length, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~causal, self._mask_min)
        out = self.model(
            input_ids=ids,
            position_ids=torch.arange(length, device=self.device).unsqueeze(0),
            attention_mask=mask,
            **{self._cache_arg: self.cache},
            use_cache=True,
            logits_to_keep=0 if all_positions else 1,
        )
        return out.logits[0]

    @torch.inference_mode()
    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        before_lm_head: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One batched forward: row b (slot b) appends `tokens[b]` at `positions[b]`.
        Returns logits [B, V] for each row's next token. `before_lm_head` runs once, as late
        in the forward as the model lets it: right before the lm_head with `fast_decode`, else
        before the forward."""
        pos = torch.tensor(positions, device=self.device)
        kv_len = max(positions) + 1
        visible = torch.arange(kv_len, device=self.device).unsqueeze(0) <= pos.unsqueeze(1)
        mask = torch.zeros(len(tokens), 1, 1, kv_len, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible[:, None, None, :], self._mask_min)
        self.cache.plan_decode(pos, kv_len)
        ids = torch.tensor(tokens, device=self.device)
        if self._fast is not None:
            return self._fast(ids, pos, mask, before_lm_head)
        if before_lm_head is not None:
            before_lm_head()
        out = self.model(
            input_ids=ids.unsqueeze(1),
            position_ids=pos.unsqueeze(1),
            attention_mask=mask,
            **{self._cache_arg: self.cache},
            use_cache=True,
        )
        return out.logits[:, -1]

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)
