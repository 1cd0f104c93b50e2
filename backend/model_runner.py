"""Runs the Hugging Face causal LM: prefill one prompt, or decode one token for every sequence."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from backend.context_length import served_context_length
from backend.contract import DEFAULT_MAX_NUM_SEQS
from backend.fast_decode import FastDecoder, unsupported_reason
from backend.host_memory import available_bytes
from backend.kv_cache import SlotKVCache, bytes_per_slot
from backend.model_folder import load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device}: torch sees no CUDA device here")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def free_memory(device: torch.device) -> int:
    """Bytes a KV cache could still take: free memory on the GPU, available RAM on CPU (within
    a container's memory limit)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_bytes()


def eos_token_ids(generation_config: GenerationConfig | None, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: the model's generation config's (chat models list
    several; without a generation_config.json transformers derives it from the model config,
    as vLLM does), and the tokenizer's."""
    ids: set[int] = set()
    configured = None if generation_config is None else generation_config.eos_token_id
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


SAMPLING_DEFAULT_RANGES = {
    "temperature": (0.0, float("inf")),
    "top_p": (1e-9, 1.0),
    "top_k": (0, float("inf")),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-9, float("inf")),
}
"""The generation config's sampling values a request falls back to, as vLLM reads them
(`get_diff_sampling_param`), with the ranges `parse_request` holds requests to."""


def sampling_defaults(generation: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """The sampling values the model's generation_config.json sets apart from transformers'
    defaults (`generation`: its `to_diff_dict`, as vLLM reads it): Qwen's temperature 0.7, top_p
    0.8, top_k 20, ... A value out of range is left out, with a warning."""
    chosen = []
    for name, value in generation.items():
        if name not in SAMPLING_DEFAULT_RANGES or value is None:
            continue
        low, high = SAMPLING_DEFAULT_RANGES[name]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            logger.warning("generation_config.json: %s=%r is out of range; not used", name, value)
            continue
        chosen.append((name, int(value) if name == "top_k" else float(value)))
    if chosen:
        logger.info("sampling defaults from generation_config.json: %s", dict(chosen))
    return tuple(chosen)


def generation_max_new_tokens(generation: Mapping[str, Any]) -> int | None:
    """generation_config.json's `max_new_tokens` (`generation`: its `to_diff_dict`), which vLLM
    takes as a cap on every request's `max_tokens` (`get_max_tokens`); None where it sets none
    (or no positive one)."""
    value = generation.get("max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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


class AttentionMasks:
    """The additive masks a forward attends with. transformers uses a prepared 4D mask as it is,
    so a sliding window must be in it: the layers that have one (all, or those `layer_types`
    names "sliding_attention", which then take a mask per type) see no key `sliding_window` or
    more positions back."""

    _KINDS = frozenset({"full_attention", "sliding_attention"})

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        config = config.get_text_config()
        layer_types = getattr(config, "layer_types", None)
        kinds = set(layer_types) if isinstance(layer_types, list) else set()
        if kinds - self._KINDS:
            raise ValueError(
                f"attention layer types {sorted(kinds - self._KINDS)} are not supported"
            )
        self.window: int | None = getattr(config, "sliding_window", None) or None
        if isinstance(layer_types, list) and "sliding_attention" not in kinds:
            self.window = None  # `layer_types` says which layers have it: here none (Qwen2's
            # `max_window_layers` >= its layers keeps `sliding_window` set all the same)
        self._per_kind = self.window is not None and isinstance(layer_types, list)
        self._dtype, self._device = dtype, device
        self._min = torch.finfo(dtype).min

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self._dtype, device=self._device)
        return mask.masked_fill_(~allowed, self._min).unsqueeze(1)

    def __call__(
        self, query_positions: torch.Tensor, kv_len: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Masks [B, 1, Q, kv_len] for queries at `query_positions` [B, Q] over keys 0..kv_len-1."""
        if self.window is None:
            return self.causal(query_positions, kv_len)
        distance = self._distance(query_positions, kv_len)
        windowed = self._additive((distance >= 0) & (distance < self.window))
        if self._per_kind:
            return {"full_attention": self._additive(distance >= 0), "sliding_attention": windowed}
        return windowed

    def causal(self, query_positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The mask without a window: every earlier key."""
        return self._additive(self._distance(query_positions, kv_len) >= 0)

    def _distance(self, query_positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[B, Q, K]: how many positions back each key is from each query."""
        return query_positions.unsqueeze(-1) - torch.arange(kv_len, device=self._device)


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
        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' wrapper hides Module.to
        if self.device.type == "cpu":
            column_major_lm_head(self.model)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        generation_config = self.model.generation_config
        self.eos_ids = eos_token_ids(generation_config, self.tokenizer)
        generation = {} if generation_config is None else generation_config.to_diff_dict()
        self.sampling_defaults = sampling_defaults(generation)
        self.max_new_tokens = generation_max_new_tokens(generation)
        self.max_model_len = served_context_length(config, max_model_len)
        self._masks = AttentionMasks(config, self.dtype, self.device)
        per_slot = bytes_per_slot(config, self.max_model_len, self.dtype)
        slots = max_num_seqs
        if kv_cache_bytes > 0:
            slots = min(slots, kv_cache_bytes // per_slot)
        if slots < 1:
            raise ValueError(
                f"a KV cache of {kv_cache_bytes} bytes holds no sequence of {self.max_model_len} "
                f"tokens ({per_slot} bytes each): raise it or lower max_model_len"
            )
        # Allocated up front for every slot's whole context: refuse what cannot fit, rather
        # than fail (or swap) later. 32 sequences of Qwen2.5-0.5B's 32768 tokens are 26 GB.
        free = free_memory(self.device)
        if slots * per_slot > free:
            raise ValueError(
                f"the KV cache for {slots} sequences of {self.max_model_len} tokens needs "
                f"{slots * per_slot / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB are free on "
                f"{self.device}: lower max_model_len or max_num_seqs, or set kv_cache_memory_mb"
            )
        self.cache = SlotKVCache(config, slots, self.max_model_len, self.device, self.dtype)
        # The keyword the model takes its cache by: `cache` in transformers 5.24 (the pin, which
        # still maps `past_key_values` to it, with a warning), `past_key_values` in 5.17 (the GPU
        # image's, which would silently ignore `cache`; docs/design.md, "The prepared GPU check").
        forward = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self.fast_decode_off_reason = (
            unsupported_reason(self.model) if fast_decode else "fast_decode is off"
        )
        self._fast = None if self.fast_decode_off_reason else FastDecoder(self.model, self.cache)
        if self.fast_decode_off_reason:  # transformers' forward: correct, slower per step
            logger.info("decoding with transformers' forward: %s", self.fast_decode_off_reason)
        self._check_against_plain_forward()

    def _check_against_plain_forward(self) -> None:
        """Refuses, at load, a model this runner does not serve as its own forward computes it:
        one whose layers need more than the slot cache and a 4D mask give them (ALiBi models
        build their biases from a 2-D padding mask, for one). A prefill and two decode steps
        against the plain forward over the same 8 tokens (fewer in a smaller context); values
        are compared in float32 only, where the two orders of computation agree to ~1e-5 (lower
        precisions differ by more than a broken model might)."""
        ids = [i % self.vocab_size for i in range(1, min(8, self.max_model_len) + 1)]
        prompt = max(1, len(ids) - 2)
        try:
            got = torch.cat(
                [
                    self.prefill(0, ids[:prompt], all_positions=True),
                    *(self.decode([ids[i]], [i]) for i in range(prompt, len(ids))),
                ]
            )
            with torch.inference_mode():
                plain = self.model(
                    input_ids=torch.tensor([ids], device=self.device), use_cache=False
                )
        except Exception as exc:
            raise ValueError(
                f"{type(self.model).__name__} is not supported by the engine: its forward "
                f"through the slot KV cache fails: {type(exc).__name__}: {exc}"
            ) from exc
        want = plain.logits[0]
        error = (got - want).abs().max().item()
        if self.dtype == torch.float32 and not error <= 1e-3 * max(1.0, want.abs().max().item()):
            raise ValueError(
                f"{type(self.model).__name__} is not supported by the engine: through the slot KV "
                f"cache its logits differ from its own forward's by up to {error:.3g}"
            )

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
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=self._masks(positions, length),
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
        self.cache.plan_decode(pos, kv_len)
        ids = torch.tensor(tokens, device=self.device)
        if self._fast is not None:  # a model without a sliding window
            return self._fast(
                ids, pos, self._masks.causal(pos.unsqueeze(1), kv_len), before_lm_head
            )
        if before_lm_head is not None:
            before_lm_head()
        out = self.model(
            input_ids=ids.unsqueeze(1),
            position_ids=pos.unsqueeze(1),
            attention_mask=self._masks(pos.unsqueeze(1), kv_len),
            **{self._cache_arg: self.cache},
            use_cache=True,
        )
        return out.logits[:, -1]

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)
