"""The torch path of `gather_logprobs`: what serves on CPU, chunked so memory stays bounded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.common import (
    LogprobInputs,
    LogprobOutput,
    empty_output,
    empty_token_logprobs,
    prepare_inputs,
)

_CHUNK_ELEMENTS = 1 << 18
"""Logits handled at a time (a whole number of rows, at least one): 1 MiB in fp32, so that a
chunk stays in cache through its max, sum-exp, top-k and rank, and memory stays bounded."""


def gather_logprobs_torch(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    return_rank: bool = False,
) -> LogprobOutput:
    """`kernels.gather_logprobs` in vectorised torch ops; used on CPU, valid on any device.

    It never writes a [B, V] log-softmax: one pass over row chunks in fp32 for the row
    statistics, top-k and rank, then gathers for the few ids asked for. On CUDA it syncs, to
    find the rows whose top-k needs a tie fix.
    """
    inputs = prepare_inputs(logits, sampled_ids, top_k, token_ids, row_offsets, return_rank)
    if logits.shape[0] == 0:
        return empty_output(inputs)
    rows = torch.arange(logits.shape[0], device=logits.device)
    sampled_logits = _gather_or_neg_inf(logits, rows, inputs.sampled_ids)
    scan = _scan_rows(logits, top_k, sampled_logits if return_rank else None)
    row_max, log_sum = scan.row_max, scan.log_sum
    return LogprobOutput(
        # (x - max) - log_sum: adding max and log_sum first would round to the max's ulp.
        sampled_logprobs=(sampled_logits - row_max) - log_sum,
        top_ids=scan.top_ids.to(torch.int32),
        top_logprobs=(scan.top_logits - row_max[:, None]) - log_sum[:, None],
        token_logprobs=_token_logprobs(inputs, row_max, log_sum),
        sampled_ranks=None if scan.n_greater is None else scan.n_greater + 1,
    )


def _gather_or_neg_inf(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`logits[rows, ids]` in fp32, -inf where an id is outside [0, V)."""
    n_vocab = logits.shape[1]
    valid = (ids >= 0) & (ids < n_vocab)
    values = logits[rows, ids.clamp(0, n_vocab - 1)].float()
    return values.masked_fill(~valid, float("-inf"))


@dataclass(frozen=True)
class _RowScan:
    row_max: torch.Tensor
    """[B] fp32."""
    log_sum: torch.Tensor
    """[B] fp32 log(sum(exp(x - row_max))), kept apart from the max: a logprob is then
    (x - max) - log_sum, where max + log_sum would be rounded to the max's ulp (6e-5 at 1000)."""
    top_ids: torch.Tensor
    """[B, k] int64, by logit descending, ties to the lower id."""
    top_logits: torch.Tensor
    """[B, k] fp32."""
    n_greater: torch.Tensor | None
    """[B] int64 #logits > the sampled logit, when asked."""


def _scan_rows(logits: torch.Tensor, k: int, sampled_logits: torch.Tensor | None) -> _RowScan:
    """Everything that needs the whole row, from one read of each fp32 chunk of rows."""
    n_rows, n_vocab = logits.shape
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // n_vocab)
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, n_rows, rows_per_chunk):
        x = logits[start : start + rows_per_chunk].float()
        row_max = x.amax(dim=1)
        log_sum = _log_sum_exp_below(x, row_max)
        top_ids, top_logits = _top_k(x, k)
        part: tuple[torch.Tensor, ...] = (row_max, log_sum, top_ids, top_logits)
        if sampled_logits is not None:
            threshold = sampled_logits[start : start + rows_per_chunk, None]
            part += (torch.count_nonzero(x > threshold, dim=1),)
        parts.append(part)
    row_max, log_sum, top_ids, top_logits, *greater = (
        torch.cat(column) for column in zip(*parts, strict=True)
    )
    return _RowScan(row_max, log_sum, top_ids, top_logits, greater[0] if greater else None)


def _log_sum_exp_below(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """[B] fp32 log(sum(exp(x - row_max))) of fp32 rows.

    Summed in float32 (2e-7 from float64 here). A float64 sum cost 0.36 of a 16 x 32000 step's
    1.0 ms of logprobs and did not remove the ~1.1e-5 deviation seen in some processes
    (tests/kernels/test_logprobs.py, TORCH_PATH_ATOL). On CPU numpy's SIMD exp, about twice as
    fast as torch's: the whole took 0.33-0.50 ms on [16, 32000] against 0.55-0.86, alternating,
    with the same error from float64 (1.8e-7).
    """
    shifted = (x - row_max[:, None]).detach()
    if shifted.device.type == "cpu":
        values = shifted.numpy()  # the tensor's memory: exp in place
        np.exp(values, out=values)
    else:
        shifted.exp_()
    return shifted.sum(dim=1).log_()


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits per row as (int64 ids, fp32 values), ties to the lower id.

    `torch.topk` leaves the order of equal values unspecified, and bf16 logits tie often. It is
    asked for k + 1 values: only rows whose k-th and (k+1)-th values are equal can have chosen
    the wrong ids among the tied ones, and only those rows are recomputed.
    """
    n_rows, n_vocab = logits.shape
    if k == 0:
        empty = torch.empty(n_rows, 0, device=logits.device)
        return empty.long(), empty
    values, ids = torch.topk(logits, min(k + 1, n_vocab), dim=1)
    if values.shape[1] > k:
        tied = (values[:, k - 1] == values[:, k]).nonzero().squeeze(1)
        if tied.numel():
            ids[tied, :k] = _ids_with_boundary_ties(logits[tied], values[tied, k - 1], k)
            values[tied, :k] = logits[tied].gather(1, ids[tied, :k])
    ids, values = ids[:, :k], values[:, :k].float()
    # Order the k chosen entries by (value desc, id asc): ids ascending, then a stable sort.
    ids, order = ids.sort(dim=1)
    values, order = values.gather(1, order).sort(dim=1, descending=True, stable=True)
    return ids.gather(1, order), values


def _ids_with_boundary_ties(logits: torch.Tensor, kth_value: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the top k per row: all above the k-th value, then the lowest ids equal to it."""
    above = logits > kth_value[:, None]
    at = logits == kth_value[:, None]
    wanted = k - above.sum(dim=1, keepdim=True)
    chosen = above | (at & (at.cumsum(dim=1) <= wanted))
    return chosen.nonzero()[:, 1].view(-1, k)


def _token_logprobs(
    inputs: LogprobInputs, row_max: torch.Tensor, log_sum: torch.Tensor
) -> torch.Tensor:
    """Logprobs of the explicit ids, each looked up in its row.

    Padded [B, Kmax] ids: one `gather` along V, and the row statistics broadcast. Flat ids with
    offsets: one flat `take` at row * V + id (logical indices, so strided rows work too), the
    rows repeated from the offsets. On CPU, 16 x 1024 ids measured 0.14 ms padded against
    0.42 ms flat (64 x 1024: 0.29 against 1.35), and flat against 0.90 ms with searchsorted.
    """
    if inputs.token_ids is None or inputs.row_offsets is None:
        return empty_token_logprobs(inputs)
    n_rows, n_vocab = inputs.logits.shape
    if len(inputs.token_shape) == 2:
        ids = inputs.token_ids.view(inputs.token_shape)
        values = inputs.logits.gather(1, ids.clamp(0, n_vocab - 1)).float()
        logprobs = (values - row_max[:, None]) - log_sum[:, None]
        return logprobs.masked_fill_((ids < 0) | (ids >= n_vocab), float("-inf"))
    ids = inputs.token_ids
    counts = inputs.row_offsets[1:] - inputs.row_offsets[:-1]
    rows = torch.repeat_interleave(
        torch.arange(n_rows, device=ids.device), counts, output_size=ids.numel()
    )
    valid = (ids >= 0) & (ids < n_vocab)
    values = inputs.logits.take(rows * n_vocab + ids.clamp(0, n_vocab - 1)).float()
    logprobs = (values - row_max[rows]) - log_sum[rows]
    return logprobs.masked_fill_(~valid, float("-inf")).reshape(inputs.token_shape)
