"""A lean decode step and prefill for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3).

Why: a decode step feeds one token per sequence, so with a small model the work per layer is a
few tiny GEMMs, and transformers' per-module Python (hooks, kwargs plumbing, config lookups,
mask and attention dispatch) costs more than the arithmetic: ~1 ms per layer on this CPU. A
prefill of a short prompt is as small, and holds the engine thread (and the GIL) as long. This
runs the same math on the same weights (the model's own parameters and rotary module, the
`SlotKVCache` layers' `update`) as straight torch calls.

`unsupported_reason` decides, from the module structure, whether a model qualifies; anything
else (other architectures, sliding windows, biases on o_proj/MLP) keeps transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from backend.kv_cache import SlotKVCache

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
PACKED_LM_HEAD_MIN_ROWS = 4
"""From this many rows a decode or prefill computes its logits through the packed lm_head."""
_PACKED_FOR_ROWS = 64  # the batch oneDNN lays the weight out for: the fastest of 1, 16, 64


@dataclass(frozen=True)
class _Layer:
    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    q: tuple[torch.Tensor, torch.Tensor | None]
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: torch.Tensor
    q_norm: tuple[torch.Tensor, float] | None  # Qwen3's per-head norms
    k_norm: tuple[torch.Tensor, float] | None
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def _norm(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' RMSNorm: statistics in float32, weight applied in the input dtype."""
    weight, eps = norm
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def packed_lm_head(weight: torch.Tensor) -> torch.Tensor | None:
    """The output projection's weight laid out once by oneDNN for its float32 GEMM on CPU; None
    elsewhere.

    Why: on CPU MKL's GEMM of a few rows by the [V, H] weight runs far below the core's speed
    (3.0-3.3 ms for 16 rows of the default model), and oneDNN's on a packed weight takes 1.9 ms
    with the same values (docs/design.md, "The engine step"). For one or two rows it is slower
    inside a decode step, so fewer than `PACKED_LM_HEAD_MIN_ROWS` keep `F.linear`."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_FOR_ROWS)


def unsupported_reason(model: Any) -> str | None:
    """None when `model` has the Llama-family structure this module implements."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.o_proj.bias is not None or any(
            p.bias is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ):
            return "biases on o_proj or the MLP"
    return None


class FastDecoder:
    """One decode step for rows 0..B-1 of a `SlotKVCache`, or one prompt's prefill into a slot
    (the cache's plan, which the caller sets, says which)."""

    def __init__(self, model: Any, cache: SlotKVCache) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no fast decode path: {reason}")
        config = model.config
        self._cache = cache
        self._embed = model.model.embed_tokens.weight
        self._rotary = model.model.rotary_emb
        self._final_norm = _norm(model.model.norm)
        self._lm_head = model.lm_head.weight
        self._packed_lm_head = packed_lm_head(self._lm_head)
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads or self._heads
        self._head_dim = model.model.layers[0].self_attn.head_dim
        self._scaling = float(model.model.layers[0].self_attn.scaling)
        self._layers = [self._layer(layer) for layer in model.model.layers]

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp

        def linear(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            return module.weight, module.bias

        return _Layer(
            input_norm=_norm(layer.input_layernorm),
            post_norm=_norm(layer.post_attention_layernorm),
            q=linear(attn.q_proj),
            k=linear(attn.k_proj),
            v=linear(attn.v_proj),
            o=attn.o_proj.weight,
            q_norm=_norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
            k_norm=_norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
            gate=mlp.gate_proj.weight,
            up=mlp.up_proj.weight,
            down=mlp.down_proj.weight,
        )

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        before_lm_head: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Decode: `tokens`, `positions`: [B]; `mask`: additive [B, 1, 1, L]. Logits [B, V].
        `before_lm_head` runs after the layers, before the final norm and the lm_head."""
        batch = tokens.shape[0]
        groups = self._heads // self._kv_heads

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            # One query per row: attend on the kv heads, a kv head's query heads as its rows
            # (transformers' `pack_gqa`), so keys and values are never repeated.
            q = q.reshape(batch, self._kv_heads, groups, self._head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, mask, scale=self._scaling)
            return out.reshape(batch, 1, -1)

        hidden = self._layers_forward(tokens.unsqueeze(1), positions.unsqueeze(1), attend)
        if before_lm_head is not None:
            before_lm_head()
        return self._logits(hidden[:, 0])

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, all_positions: bool) -> torch.Tensor:
        """One prompt `tokens` [P] into the slot the cache's prefill plan names, attending
        causally. Logits [P, V] when `all_positions`, else [1, V] for the last position."""
        length = tokens.shape[0]
        gqa = self._kv_heads != self._heads

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self._scaling, enable_gqa=gqa
            )
            return out.transpose(1, 2).reshape(1, length, -1)

        positions = torch.arange(length, device=tokens.device).unsqueeze(0)
        hidden = self._layers_forward(tokens.unsqueeze(0), positions, attend)
        return self._logits(hidden[0] if all_positions else hidden[0, -1:])

    def _layers_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`tokens`, `positions`: [B, T] -> hidden states [B, T, hidden] after the last layer;
        `attend(q [B, heads, T, D], keys, values)` gives the attention output [B, T, heads * D]."""
        batch, steps = tokens.shape
        hidden = F.embedding(tokens, self._embed)
        cos, sin = self._rotary(hidden, positions)
        for index, layer in enumerate(self._layers):
            x = _rms_norm(hidden, layer.input_norm)
            q = F.linear(x, *layer.q).view(batch, steps, self._heads, self._head_dim)
            k = F.linear(x, *layer.k).view(batch, steps, self._kv_heads, self._head_dim)
            v = F.linear(x, *layer.v).view(batch, steps, self._kv_heads, self._head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = self._cache.slot_layers[index].update(k, v.transpose(1, 2))
            hidden = hidden + F.linear(attend(q, keys, values), layer.o)
            x = _rms_norm(hidden, layer.post_norm)
            hidden = hidden + F.linear(
                F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up), layer.down
            )
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` [rows, H] -> logits [rows, V]."""
        x = _rms_norm(hidden, self._final_norm)
        if self._packed_lm_head is not None and x.shape[0] >= PACKED_LM_HEAD_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_lm_head, None, "none", [], "")
        return F.linear(x, self._lm_head)
