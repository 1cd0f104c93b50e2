"""A slot KV cache for continuous batching, through transformers' public `Cache` interface.

Each layer holds keys and values as `[slots, kv_heads, max_len, head_dim]`; a sequence owns one
slot for its lifetime. Active sequences occupy slots `0..B-1`, so a decode step writes one
position per row and attends over a view `[:B, :, :L]`: nothing is copied per step. When a
sequence leaves, the last slot's contents move into the hole (one sequence copied, once).

The model sees an ordinary `Cache`: its attention layers call `update()` and get keys and values
back, so any transformers decoder that takes `cache=`, `position_ids=` and a 4D additive mask
(Llama, Qwen2/3, Mistral, Phi3, GPT-NeoX style, ...) runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class _Plan:
    """Where the next forward writes: prefill of one slot, or one token for rows 0..B-1."""

    slot: int | None  # prefill (positions 0..kv_len-1 of this slot); None for decode
    positions: torch.Tensor | None  # decode: [B] position written per row
    kv_len: int  # keys/values returned span [0, kv_len)


class _SlotLayer(CacheLayerMixin):
    def __init__(self, owner: SlotKVCache, shape: tuple[int, ...], device, dtype) -> None:
        super().__init__()
        self._owner = owner
        # Typed handles on the storage; the mixin's `keys` / `values` (optional there) are the
        # same tensors, for transformers code that reads them.
        self.slot_keys = torch.zeros(shape, device=device, dtype=dtype)
        self.slot_values = torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = self.slot_keys, self.slot_values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage is allocated up front (the memory budget is fixed at start)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._owner.current_plan
        keys, values = self.slot_keys, self.slot_values
        if plan.slot is not None:  # prefill: [1, H, T, D] into one slot
            keys[plan.slot, :, : plan.kv_len] = key_states[0]
            values[plan.slot, :, : plan.kv_len] = value_states[0]
            rows = slice(plan.slot, plan.slot + 1)
        else:  # decode: [B, H, 1, D], one position per row
            batch = key_states.shape[0]
            index = torch.arange(batch, device=key_states.device)
            keys[index, :, plan.positions] = key_states[:, :, 0]
            values[index, :, plan.positions] = value_states[:, :, 0]
            rows = slice(0, batch)
        return keys[rows, :, : plan.kv_len], values[rows, :, : plan.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.current_plan.kv_len, 0

    def get_seq_length(self) -> int:
        return self._owner.plan.kv_len if self._owner.plan is not None else 0

    def get_max_length(self) -> int:
        return self.slot_keys.shape[2]


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers decoder config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def bytes_per_slot(config: Any, max_len: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = _kv_shape(config)
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * layers * kv_heads * max_len * head_dim * element


class SlotKVCache(Cache):
    def __init__(
        self, config: Any, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        layers, kv_heads, head_dim = _kv_shape(config)
        shape = (num_slots, kv_heads, max_len, head_dim)
        self.slot_layers = [_SlotLayer(self, shape, device, dtype) for _ in range(layers)]
        super().__init__(layers=list(self.slot_layers))
        self.num_slots = num_slots
        self.max_len = max_len
        self.plan: _Plan | None = None

    @property
    def current_plan(self) -> _Plan:
        """The plan of the forward running now; a forward without one is a bug."""
        if self.plan is None:
            raise RuntimeError("SlotKVCache: a forward ran before plan_prefill / plan_decode")
        return self.plan

    def plan_prefill(self, slot: int, length: int) -> None:
        self.plan = _Plan(slot=slot, positions=None, kv_len=length)

    def plan_decode(self, positions: torch.Tensor, kv_len: int) -> None:
        self.plan = _Plan(slot=None, positions=positions, kv_len=kv_len)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's first `length` positions from slot `src` to slot `dst`."""
        for layer in self.slot_layers:
            layer.slot_keys[dst, :, :length] = layer.slot_keys[src, :, :length]
            layer.slot_values[dst, :, :length] = layer.slot_values[src, :, :length]
