"""The result type and input normalisation shared by the Triton and torch paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.contract import MAX_TOP_K  # the kernel keeps at most 32 candidates per program

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LogprobOutput:
    """Logprobs of one decode step for the whole batch, all on the logits' device."""

    sampled_logprobs: torch.Tensor
    """[B] fp32: logprob of `sampled_ids[b]` (-inf for an id outside [0, V))."""
    top_ids: torch.Tensor
    """[B, k] int32: the k most likely ids, by logprob descending, ties to the lower id."""
    top_logprobs: torch.Tensor
    """[B, k] fp32: their logprobs."""
    token_logprobs: torch.Tensor
    """Logprobs of `token_ids`, in its layout: flat [N], or [B, Kmax] for padded input, [0] when
    absent; -inf for an id outside [0, V), -1 padding included."""
    sampled_ranks: torch.Tensor | None
    """[B] int64 when asked: 1 + the number of ids with a strictly greater logit (vLLM's rank)."""


@dataclass(frozen=True)
class LogprobInputs:
    """Validated arguments in the one layout both paths compute on."""

    logits: torch.Tensor
    """[B, V] fp32/bf16/fp16, unit stride along V."""
    sampled_ids: torch.Tensor
    """[B] int64 on the logits' device."""
    top_k: int
    token_ids: torch.Tensor | None
    """Flat [N] int64, N > 0, or None when no explicit ids were asked for."""
    row_offsets: torch.Tensor | None
    """[B + 1] int64: row b's ids are `token_ids[row_offsets[b]:row_offsets[b + 1]]`."""
    token_shape: tuple[int, ...]
    """Shape of `token_logprobs` as returned: (N,), (B, Kmax) or (0,)."""
    return_rank: bool


def prepare_inputs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int,
    token_ids: torch.Tensor | None,
    row_offsets: torch.Tensor | None,
    return_rank: bool,
) -> LogprobInputs:
    """Check shapes and dtypes and bring ids into one layout, without a host synchronisation.

    Ids become int64 so that the kernel compiles one variant whatever int type the caller holds
    (and a wide id is never truncated into range). Padded [B, Kmax] ids become flat ids with
    offsets `b * Kmax`; -1 padding then reads as an out-of-range id, which gives -inf. The
    offsets' contents are a precondition, not checked (that would need a sync): non-decreasing,
    `row_offsets[0] == 0` and `row_offsets[B] == N`.
    """
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(
            f"logits must be [B, V] fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}"
        )
    n_rows, n_vocab = logits.shape
    if n_vocab == 0 or (n_vocab > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must have V > 0 and unit stride along V, got {logits.stride()}")
    if sampled_ids.shape != (n_rows,) or sampled_ids.is_floating_point():
        raise ValueError(f"sampled_ids must be int [{n_rows}], got {tuple(sampled_ids.shape)}")
    if not 0 <= top_k <= min(MAX_TOP_K, n_vocab):
        raise ValueError(f"top_k must be in [0, {min(MAX_TOP_K, n_vocab)}], got {top_k}")
    device = logits.device
    sampled = sampled_ids.to(device=device, dtype=torch.int64)

    token_shape: tuple[int, ...] = (0,)
    flat = offsets = None
    if token_ids is not None:
        if token_ids.is_floating_point():
            raise ValueError("token_ids must be an integer tensor")
        if row_offsets is None:
            if token_ids.dim() != 2 or token_ids.shape[0] != n_rows:
                raise ValueError(
                    f"padded token_ids must be [{n_rows}, Kmax], got {tuple(token_ids.shape)}"
                )
            token_shape = tuple(token_ids.shape)
            flat = token_ids.reshape(-1)
            offsets = torch.arange(n_rows + 1, device=device) * token_ids.shape[1]
        else:
            if token_ids.dim() != 1 or row_offsets.shape != (n_rows + 1,):
                raise ValueError(
                    f"flat token_ids must be [N] with row_offsets [{n_rows + 1}], got "
                    f"{tuple(token_ids.shape)} and {tuple(row_offsets.shape)}"
                )
            token_shape = tuple(token_ids.shape)
            flat, offsets = token_ids, row_offsets
        if flat.numel() == 0:
            flat = offsets = None
        else:
            flat = flat.to(device=device, dtype=torch.int64)
            offsets = offsets.to(device=device, dtype=torch.int64)
    elif row_offsets is not None:
        raise ValueError("row_offsets given without token_ids")

    return LogprobInputs(
        logits=logits,
        sampled_ids=sampled,
        top_k=top_k,
        token_ids=flat,
        row_offsets=offsets,
        token_shape=token_shape,
        return_rank=return_rank,
    )


def empty_token_logprobs(inputs: LogprobInputs) -> torch.Tensor:
    """The `token_logprobs` result when there is no id to look up (absent, or N == 0)."""
    return torch.empty(inputs.token_shape, dtype=torch.float32, device=inputs.logits.device)


def empty_output(inputs: LogprobInputs) -> LogprobOutput:
    """The result for B == 0: empty tensors of the documented shapes and dtypes."""
    device = inputs.logits.device
    return LogprobOutput(
        sampled_logprobs=torch.empty(0, dtype=torch.float32, device=device),
        top_ids=torch.empty(0, inputs.top_k, dtype=torch.int32, device=device),
        top_logprobs=torch.empty(0, inputs.top_k, dtype=torch.float32, device=device),
        token_logprobs=empty_token_logprobs(inputs),
        sampled_ranks=(
            torch.empty(0, dtype=torch.int64, device=device) if inputs.return_rank else None
        ),
    )
