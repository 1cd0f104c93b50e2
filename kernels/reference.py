"""The torch path (CPU serving) and the float64 reference the tests and the bench compare with."""

from __future__ import annotations

import torch

from kernels.common import (
    LogprobInputs,
    LogprobOutput,
    empty_output,
    empty_token_logprobs,
    prepare_inputs,
)

_CHUNK_ELEMENTS = 1 << 22
"""Logits converted to fp32 at a time (16 MiB), which bounds the working set at any B and V."""


def gather_logprobs_torch(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    return_rank: bool = False,
) -> LogprobOutput:
    """`kernels.gather_logprobs` in vectorised torch ops; used on CPU, valid on any device.

    It never writes a [B, V] log-softmax: row statistics in fp32 chunks, `topk` on the raw
    logits (log-softmax is monotonic), gathers for the rest. On CUDA it synchronises once, to
    find the rows whose top-k needs a tie fix.
    """
    inputs = prepare_inputs(logits, sampled_ids, top_k, token_ids, row_offsets, return_rank)
    if logits.shape[0] == 0:
        return empty_output(inputs)
    rows = torch.arange(logits.shape[0], device=logits.device)
    sampled_logits = _gather_or_neg_inf(logits, rows, inputs.sampled_ids)
    row_max, log_sum, n_greater = _row_stats(logits, sampled_logits if return_rank else None)
    top_ids, top_logits = _top_k(logits, top_k)
    return LogprobOutput(
        sampled_logprobs=(sampled_logits - row_max) - log_sum,
        top_ids=top_ids.to(torch.int32),
        top_logprobs=(top_logits - row_max[:, None]) - log_sum[:, None],
        token_logprobs=_token_logprobs(inputs, row_max, log_sum),
        sampled_ranks=None if n_greater is None else n_greater + 1,
    )


def _gather_or_neg_inf(
    logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`logits[rows, ids]` in fp32, -inf where an id is outside [0, V)."""
    n_vocab = logits.shape[1]
    valid = (ids >= 0) & (ids < n_vocab)
    values = logits[rows, ids.clamp(0, n_vocab - 1)].float()
    return values.masked_fill(~valid, float("-inf"))


def _row_stats(
    logits: torch.Tensor, sampled_logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row max, log(sum(exp(x - max))) and, if asked, #logits > the sampled logit, in fp32.

    Max and log-sum stay apart: a logprob is then (x - max) - log_sum, where folding them into
    one log-sum-exp first would round it to the max's ulp (6e-5 at a logit of 1000).
    """
    n_rows, n_vocab = logits.shape
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // n_vocab)
    maxes, log_sums, counts = [], [], []
    for start in range(0, n_rows, rows_per_chunk):
        x = logits[start : start + rows_per_chunk].float()
        row_max = x.amax(dim=1)
        maxes.append(row_max)
        log_sums.append(torch.exp(x - row_max[:, None]).sum(dim=1).log())
        if sampled_logits is not None:
            threshold = sampled_logits[start : start + rows_per_chunk, None]
            counts.append((x > threshold).sum(dim=1))
    return torch.cat(maxes), torch.cat(log_sums), torch.cat(counts) if counts else None


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


def _ids_with_boundary_ties(
    logits: torch.Tensor, kth_value: torch.Tensor, k: int
) -> torch.Tensor:
    """Ids of the top k per row: all above the k-th value, then the lowest ids equal to it."""
    above = logits > kth_value[:, None]
    at = logits == kth_value[:, None]
    wanted = k - above.sum(dim=1, keepdim=True)
    chosen = above | (at & (at.cumsum(dim=1) <= wanted))
    return chosen.nonzero()[:, 1].view(-1, k)


def _token_logprobs(
    inputs: LogprobInputs, row_max: torch.Tensor, log_sum: torch.Tensor
) -> torch.Tensor:
    """Logprobs of the explicit ids, each looked up in its row (found from the offsets)."""
    if inputs.token_ids is None:
        return empty_token_logprobs(inputs)
    positions = torch.arange(inputs.token_ids.numel(), device=inputs.token_ids.device)
    rows = torch.searchsorted(inputs.row_offsets[1:], positions, right=True)
    values = _gather_or_neg_inf(inputs.logits, rows, inputs.token_ids)
    return ((values - row_max[rows]) - log_sum[rows]).reshape(inputs.token_shape)


def reference_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    return_rank: bool = False,
) -> LogprobOutput:
    """The same results in float64 from the plainest ops (full log-softmax, full stable sort).

    Slow and memory-hungry by design: it is the yardstick, with logprobs left in float64.
    """
    inputs = prepare_inputs(logits, sampled_ids, top_k, token_ids, row_offsets, return_rank)
    n_rows, n_vocab = logits.shape
    # A -inf column at index V, where every out-of-range id is sent; it adds 0 to the sum-exp.
    x = torch.cat([logits.double(), logits.new_full((n_rows, 1), float("-inf")).double()], dim=1)
    logprobs = x.log_softmax(dim=1)

    def column(ids: torch.Tensor) -> torch.Tensor:
        return torch.where((ids >= 0) & (ids < n_vocab), ids, n_vocab)

    rows = torch.arange(n_rows, device=x.device)
    sampled = column(inputs.sampled_ids)
    sorted_logprobs, order = logprobs[:, :n_vocab].sort(dim=1, descending=True, stable=True)
    if inputs.token_ids is None:
        tokens = torch.empty(inputs.token_shape, dtype=torch.float64, device=x.device)
    else:
        counts = inputs.row_offsets[1:] - inputs.row_offsets[:-1]
        token_rows = torch.repeat_interleave(rows, counts)
        tokens = logprobs[token_rows, column(inputs.token_ids)].reshape(inputs.token_shape)
    ranks = None
    if return_rank:
        ranks = (x > x[rows, sampled][:, None]).sum(dim=1) + 1
    return LogprobOutput(
        sampled_logprobs=logprobs[rows, sampled],
        top_ids=order[:, :top_k].to(torch.int32),
        top_logprobs=sorted_logprobs[:, :top_k],
        token_logprobs=tokens,
        sampled_ranks=ranks,
    )
