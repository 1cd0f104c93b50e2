"""Logprobs for a decode batch (sampled, top-k, explicit ids) in one read of the logits."""

from __future__ import annotations

import numpy as np
import torch

from kernels.common import LogprobOutput
from kernels.logprobs import INTERPRET, gather_logprobs_triton
from kernels.torch_path import HostLogprobs, gather_logprobs_host, gather_logprobs_torch

__all__ = ["HostLogprobs", "LogprobOutput", "gather_logprobs", "gather_logprobs_on_host"]


def gather_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    return_rank: bool = False,
) -> LogprobOutput:
    """Logprobs of the raw logits' log-softmax, for the sampled ids, the top k and explicit ids.

    logits: [B, V] fp32/bf16/fp16, unit stride along V (rows may be strided).
    sampled_ids: [B], any int dtype. top_k: 0..20 (and <= V).
    token_ids: flat [N] with `row_offsets` [B + 1] (row b owns `token_ids[off[b]:off[b + 1]]`),
    or padded [B, Kmax] with -1 padding and no offsets, or None.
    return_rank: also return the sampled ids' ranks.

    Any id outside [0, V) gets -inf. CUDA tensors run the Triton kernels without a host
    synchronisation; CPU tensors run the torch path, or the Triton kernels when
    TRITON_INTERPRET=1 was set before `kernels` was imported (how CI tests the kernels).
    `kernels.logprobs.gather_logprobs_triton` and `kernels.torch_path.gather_logprobs_torch`
    force one path.
    """
    run = gather_logprobs_triton if logits.is_cuda or INTERPRET else gather_logprobs_torch
    return run(logits, sampled_ids, top_k, token_ids, row_offsets, return_rank)


def gather_logprobs_on_host(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: np.ndarray | None = None,
) -> HostLogprobs:
    """`gather_logprobs` for rows of logits (a decode batch, a prompt's positions), with valid
    int64 ids padded to [B, Kmax] with -1 (or None), and the results as host arrays. CPU logits
    go straight to the host path, with no validation and few torch calls: the engine's logprob
    worker runs this beside the next forward, and each torch call hands the GIL over
    (docs/design.md, "Logprobs beside the next forward"). Other logits run `gather_logprobs`,
    then copy each result to the host."""
    if logits.device.type == "cpu" and not INTERPRET:
        return gather_logprobs_host(logits, sampled_ids.numpy(), top_k, token_ids)
    ids = None if token_ids is None else torch.from_numpy(token_ids).to(logits.device)
    out = gather_logprobs(logits, sampled_ids, top_k=top_k, token_ids=ids)
    return HostLogprobs(
        sampled_logprobs=out.sampled_logprobs.cpu().numpy(),
        top_ids=out.top_ids.cpu().numpy(),
        top_logprobs=out.top_logprobs.cpu().numpy(),
        token_logprobs=out.token_logprobs.cpu().numpy(),
        sampled_ranks=None,
    )
