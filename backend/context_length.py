"""How many tokens (prompt and output) a model is served with: the engine and the repository the
adapter reads its limits from must agree on it (docs/design.md, "Serving other models")."""

from __future__ import annotations

from typing import Any


def _rope_parameter_sets(config: Any) -> list[dict[str, Any]]:
    """transformers 5's `rope_parameters`: one dict, or one per attention layer type."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return list(rope.values())
    return [rope]


def served_context_length(config: Any, requested: int = 0) -> int:
    """`requested` (0: the model's own limit), refused where the engine cannot serve it.

    The limit is the config's `max_position_embeddings` (GPT-2's `n_positions` through
    transformers' attribute map), lowered for LongRoPE: transformers picks its short or long
    RoPE factors from the largest position in the whole batch, so past
    `original_max_position_embeddings` one long sequence would change every other row's
    outputs, and a sequence crossing it would keep keys rotated with the short factors.
    """
    config = config.get_text_config()
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    reason = "the model's max_position_embeddings"
    for rope in _rope_parameter_sets(config):
        original = rope.get("original_max_position_embeddings")
        if rope.get("rope_type") == "longrope" and original and (not limit or original < limit):
            limit = int(original)
            reason = (
                "LongRoPE's original_max_position_embeddings: beyond it transformers switches "
                "the whole batch to the long factors"
            )
    if not limit:
        if not requested:
            raise ValueError("the model's config gives no context length: set max_model_len")
        return requested
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} is more than this model serves: {limit} ({reason})"
        )
    return requested or limit
