"""The torch path of `gather_logprobs` (its work in numpy): what serves on CPU, chunked so
memory stays bounded."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kernels.common import LogprobOutput, prepare_inputs

_CHUNK_ELEMENTS = 1 << 19
"""Logits handled at a time (a whole number of rows, at least one): 2 MiB in fp32, a decode step
of 16 rows of a 32000 vocabulary in one chunk; memory stays bounded."""

_TOP_K_GROUP = 64
"""Logits per group of `_top_k`'s first pass."""
_IN_GROUP = np.arange(_TOP_K_GROUP)

_LEAST_UNSHIFTED_SUM = 1e-20
"""Below it, a row's largest exp (at least the sum / V) might be subnormal: V up to 10**17."""


class HostLogprobs(NamedTuple):
    """`LogprobOutput`'s fields as host numpy arrays."""

    sampled_logprobs: np.ndarray
    top_ids: np.ndarray
    """int32."""
    top_logprobs: np.ndarray
    token_logprobs: np.ndarray
    """In the layout of the ids asked for: flat [N], padded [B, Kmax], or [0] without ids."""
    sampled_ranks: np.ndarray | None


def gather_logprobs_torch(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    return_rank: bool = False,
) -> LogprobOutput:
    """`kernels.gather_logprobs` on the host (`gather_logprobs_host`); valid on any device,
    whose logits it copies to the host a chunk at a time, and whose results it copies back."""
    inputs = prepare_inputs(logits, sampled_ids, top_k, token_ids, row_offsets, return_rank)
    ids = offsets = None
    if inputs.token_ids is not None:
        ids = inputs.token_ids.cpu().numpy()
        if len(inputs.token_shape) == 2:
            ids = ids.reshape(inputs.token_shape)
        else:
            offsets = None if inputs.row_offsets is None else inputs.row_offsets.cpu().numpy()
    out = gather_logprobs_host(
        logits, inputs.sampled_ids.cpu().numpy(), top_k, ids, offsets, return_rank
    )
    device = logits.device
    ranks = out.sampled_ranks
    return LogprobOutput(
        sampled_logprobs=torch.from_numpy(out.sampled_logprobs).to(device),
        top_ids=torch.from_numpy(out.top_ids).to(device),
        top_logprobs=torch.from_numpy(out.top_logprobs).to(device),
        token_logprobs=torch.from_numpy(out.token_logprobs.reshape(inputs.token_shape)).to(device),
        sampled_ranks=None if ranks is None else torch.from_numpy(ranks).to(device),
    )


def gather_logprobs_host(
    logits: torch.Tensor,
    sampled_ids: np.ndarray,
    top_k: int = 0,
    token_ids: np.ndarray | None = None,
    row_offsets: np.ndarray | None = None,
    return_rank: bool = False,
) -> HostLogprobs:
    """The torch path's work, in numpy, on arguments already valid
    (`kernels.common.prepare_inputs`): int64 ids, padded [B, Kmax] with -1 or flat [N] with
    offsets, or None; logits [B, V] of any float dtype, copied to the host a chunk at a time.

    It never writes a [B, V] log-softmax: per chunk of rows in fp32, the sum of exps, the
    top-k and the rank, then lookups of the few ids asked for. The engine calls it
    on a worker thread beside the next forward, where each torch call would hand the GIL to the
    engine thread and back, and numpy's small ops keep it; so on fp32 CPU logits its only torch
    calls read them as numpy (the engine alone's TPOT with 1024 ids a row: docs/design.md,
    "Logprobs beside the next forward").
    """
    n_rows, n_vocab = logits.shape
    padded = token_ids is not None and token_ids.ndim == 2
    # The sampled ids and padded explicit ids, read with one 2-D lookup a row.
    looked_up = sampled_ids[:, None]
    if token_ids is not None and padded:
        looked_up = np.concatenate([looked_up, token_ids], axis=1)
    flat = None if padded or token_ids is None or row_offsets is None else (token_ids, row_offsets)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // n_vocab)
    starts = range(0, n_rows, rows_per_chunk) or [0]  # B = 0: one empty chunk, empty results
    parts = [
        _chunk_logprobs(logits, looked_up, flat, top_k, return_rank, start, start + rows_per_chunk)
        for start in starts
    ]
    looked, top_ids, top_logprobs, tokens, ranks = (
        column[0] if len(column) == 1 else np.concatenate(column)
        for column in zip(*parts, strict=True)
    )
    return HostLogprobs(
        sampled_logprobs=np.ascontiguousarray(looked[:, 0]),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        token_logprobs=looked[:, 1:] if padded else tokens,
        sampled_ranks=ranks + 1 if return_rank else None,
    )


def _chunk_logprobs(
    logits: torch.Tensor,
    looked_up: np.ndarray,
    flat: tuple[np.ndarray, np.ndarray] | None,
    top_k: int,
    return_rank: bool,
    start: int,
    stop: int,
) -> tuple[np.ndarray, ...]:
    """Rows [start, stop): logprobs of `looked_up`'s ids, top-k ids and logprobs, the flat
    explicit ids' logprobs, and the number of logits above the sampled one (when asked). Each
    op it skips (a slice of all rows, an empty top-k) is one the worker does not hold the GIL
    for."""
    x = _host_fp32(logits if start == 0 and stop >= len(logits) else logits[start:stop])
    stop = start + len(x)
    log_sum = _log_sum_exp(x)
    raw = _read(x, np.arange(len(x))[:, None], looked_up[start:stop])
    tokens = np.empty(0, np.float32)
    if flat is not None:
        ids, offsets = flat
        rows = np.repeat(np.arange(len(x)), np.diff(offsets[start : stop + 1]))
        values = _read(x, rows, ids[offsets[start] : offsets[stop]])
        tokens = (values - log_sum[rows, 0]).astype(np.float32)
    ranks = np.count_nonzero(x > raw[:, :1], axis=1) if return_rank else np.empty(0, np.int64)
    top_ids, top_logprobs = _top_k(x, top_k)
    if top_k:
        top_logprobs = (top_logprobs - log_sum).astype(np.float32)
    return (raw - log_sum).astype(np.float32), top_ids, top_logprobs, tokens, ranks


def _log_sum_exp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) per row, [rows, 1] fp64, so that a logprob is `x - log_sum` rounded once.

    The exps are not shifted by the row max: two passes over the logits fewer, 0.52-0.66 ->
    0.32-0.38 ms for [16, 32000] (docs/design.md, "Logprobs beside the next forward"). A row
    whose fp32 sum overflows, or is too small for its largest exp to be a normal float, is
    summed again shifted by its max.
    """
    with np.errstate(over="ignore", divide="ignore"):  # the rows summed again below
        sums = np.exp(x).sum(axis=1)  # numpy's SIMD exp: twice torch's speed on the AMD VM
        log_sum = np.log(sums.astype(np.float64))[:, None]
    redo = ~((sums >= _LEAST_UNSHIFTED_SUM) & (sums < np.inf))  # NaN sums too
    if redo.any():
        rows = x[redo]
        row_max = rows.max(axis=1, keepdims=True)
        shifted_sums = np.exp(rows - row_max).sum(axis=1, keepdims=True)
        log_sum[redo] = row_max + np.log(shifted_sums.astype(np.float64))
    return log_sum


def _host_fp32(logits: torch.Tensor) -> np.ndarray:
    """The logits as an fp32 host array: a view of CPU fp32 ones, without a torch call."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.requires_grad:
        logits = logits.detach().to("cpu", torch.float32)
    return logits.numpy()


def _read(x: np.ndarray, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`x[rows, ids]`, -inf where an id is outside [0, V). Ids all in range (the engine's,
    unless its rows ask different numbers of ids) skip the masks: fewer ops."""
    n_vocab = x.shape[1]
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < n_vocab):
        return x[rows, ids]
    valid = (ids >= 0) & (ids < n_vocab)
    return np.where(valid, x[rows, np.where(valid, ids, 0)], np.float32(-np.inf))


def _top_k(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits per row as (int32 ids, fp32 values), ties to the lower id (NaN last).

    Exact without sorting or partitioning whole rows: a row's ids fall into groups of 64
    (`_TOP_K_GROUP`), and the (k + 1)-th largest group max is at most the row's (k + 1)-th
    largest logit, since k + 1 groups hold a logit at least that large. So every logit of the
    top k, with the ties at its boundary, lies in a group whose max reaches that threshold; only
    those few groups' logits are sorted, by (value descending, id ascending). For [16, 32000] and
    k = 5: 0.36 ms, against 1.0 ms with `torch.topk` (docs/design.md, "Logprobs beside the next
    forward").
    """
    n_rows, n_vocab = rows.shape
    if k == 0:
        return np.empty((n_rows, 0), np.int32), np.empty((n_rows, 0), np.float32)
    # Group j < width is ids j, j + width, j + 2 width, ...: their max is one pass over the rows
    # as 64 slices. The tail's ids (under 64 of them) are group `width`.
    width = n_vocab // _TOP_K_GROUP
    full = width * _TOP_K_GROUP
    group_max = rows[:, :full].reshape(n_rows, _TOP_K_GROUP, width).max(axis=1)
    if full < n_vocab:
        group_max = np.concatenate([group_max, rows[:, full:].max(axis=1, keepdims=True)], axis=1)
    nth = group_max.shape[1] - (k + 1)
    if nth < 0:  # fewer than k + 1 groups: every logit is a candidate
        threshold = np.full(n_rows, -np.inf, np.float32)
    else:
        threshold = np.partition(group_max, nth, axis=1)[:, nth]
    # `not below` rather than `at least`, so that NaN groups and a NaN threshold keep candidates.
    group_rows, groups = np.nonzero(~(group_max < threshold[:, None]))
    in_tail = groups == width
    first = np.where(in_tail, full, groups)
    stride = np.where(in_tail, 1, width)
    candidate_rows = np.repeat(group_rows, _TOP_K_GROUP)
    candidate_ids = (first[:, None] + stride[:, None] * _IN_GROUP).reshape(-1)
    values = rows[candidate_rows, np.minimum(candidate_ids, n_vocab - 1)]
    keep = ~(values < threshold[candidate_rows]) & (candidate_ids < n_vocab)
    candidate_rows, candidate_ids, values = candidate_rows[keep], candidate_ids[keep], values[keep]
    order = np.lexsort((candidate_ids, -values, candidate_rows))
    row_starts = np.searchsorted(candidate_rows[order], np.arange(n_rows))
    chosen = order[row_starts[:, None] + np.arange(k)]
    return candidate_ids[chosen].astype(np.int32), values[chosen]
