"""One vectorised sampling step for a batch of rows, each with its own parameters.

Temperature, top-k and top-p are applied as tensors over the batch. Randomness comes from each
request's own `torch.Generator` (exponential race: argmax(p / q), q ~ Exp(1), equivalent to
sampling from p), so a seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_p: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64, 0 = off
    generators: list[torch.Generator]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Set logits outside each row's top-k / nucleus to -inf, in place."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
    remove = ranks >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p; the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(-1)
    remove[:, 0] = False
    logits.scatter_(-1, order, sorted_logits.masked_fill(remove, float("-inf")))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [B] from logits [B, V] (not modified)."""
    greedy = batch.temperature <= 0
    if bool(greedy.all()):
        return logits.argmax(dim=-1)
    scaled = logits.float() / torch.where(greedy, 1.0, batch.temperature).unsqueeze(-1)
    if bool((batch.top_k > 0).any() or (batch.top_p < 1).any()):
        _filter_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for row, generator in enumerate(batch.generators):
        noise[row].exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 draw would give 0/0 = NaN
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)
