"""Logprob gathering in one read of the logits: the Triton kernels and their launcher.

Step 1, `_logprobs_kernel`, grid (B, S): program (b, s) reads V-chunk s of row b once and keeps
an online max / sum-exp in fp32 (Milakov & Gimelshein, arXiv 1805.02867), the count of logits
above the sampled one (the rank), and its chunk's best K_PAD (value, id) pairs. Step 2,
`_logprobs_merge_kernel`, grid (B,): merges the S partials of a row and gathers the few ids
asked for (sampled, top-k, explicit) straight from the logits.

Only block sizes and flags are `tl.constexpr`; V, strides, counts and k are runtime arguments,
so a new vocabulary, batch or k compiles nothing new (Triton still specialises integers on
divisibility by 16, which `warmup` covers by using the real vocabulary size).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from kernels.common import (
    LogprobInputs,
    LogprobOutput,
    empty_output,
    empty_token_logprobs,
    prepare_inputs,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels below were built for Triton's CPU interpreter (read once, at import,
because that is when `triton.jit` decides)."""

BLOCK_V = 4096
"""Logits per loop step: 16 fp32 or bf16 values per thread at 8 warps."""
MAX_SPLITS = 32
"""At most this many programs share a row; the merge step holds MAX_SPLITS * K_PAD keys."""
NUM_WARPS = 8
MERGE_NUM_WARPS = 4
BLOCK_TOKENS = 128
"""Explicit ids per loop step of the merge."""
_EMPTY_KEY = tl.constexpr(-(2**63))
"""Sort key of an unfilled top-k slot: below every real (value, id) key."""


@triton.jit
def _sort_key(x, cols):
    """Pack (fp32 value, id) into one int64 that orders by value, then by the lower id.

    One max-reduction then yields the best entry with the tie rule built in. The float bits
    are flipped to order as signed ints; -0.0 is folded into +0.0 because they compare equal.
    """
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key):
    return (0x7FFFFFFF - (key & 0x7FFFFFFF)).to(tl.int32)


@triton.jit(do_not_specialize=["split_blocks", "n_splits"])
def _logprobs_kernel(
    logits_ptr,
    stride_row,
    n_vocab,
    split_blocks,
    n_splits,
    sampled_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_rank_ptr,
    part_key_ptr,
    HAS_TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RETURN_RANK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One read of V-chunk `program_id(1)` of row `program_id(0)`.

    logits_ptr: [B, V] logits, row stride `stride_row`, unit stride along V.
    sampled_ptr: [B] int64 sampled ids (read only for the rank).
    part_max_ptr, part_sum_ptr: [B, n_splits] fp32, the chunk's max and sum(exp(x - max)).
    part_rank_ptr: [B, n_splits] int32, #logits in the chunk > the sampled logit.
    part_key_ptr: [B, n_splits, K_PAD] int64, the chunk's best K_PAD sort keys.
    HAS_TOPK, RETURN_RANK: what to compute; K_PAD: top-k slots, a power of two >= k.
    BLOCK_V: logits per loop step.
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    # A chunk is a whole number of blocks, so that masks stay aligned and loads vectorise.
    start = split.to(tl.int64) * split_blocks * BLOCK_V
    end = tl.minimum(start + split_blocks * BLOCK_V, n_vocab)
    lanes = tl.arange(0, BLOCK_V)

    # 1. The sampled logit, for the rank (-inf for an out-of-range id).
    sampled_logit = float("-inf")
    if RETURN_RANK:
        sid = tl.load(sampled_ptr + row)
        sid_ok = (sid >= 0) & (sid < n_vocab)
        sampled_logit = tl.load(row_ptr + tl.where(sid_ok, sid, 0)).to(tl.float32)
        sampled_logit = tl.where(sid_ok, sampled_logit, float("-inf"))

    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)
    n_greater = tl.zeros((BLOCK_V,), tl.int32)
    slots = tl.arange(0, K_PAD)
    top = tl.full((K_PAD,), _EMPTY_KEY, tl.int64)
    worst = tl.full((), _EMPTY_KEY, tl.int64)
    for block in range(start, end, BLOCK_V):
        cols = block + lanes
        in_chunk = cols < end
        x = tl.load(row_ptr + cols, mask=in_chunk, other=float("-inf")).to(tl.float32)

        # 2. Online max / sum-exp; a block of -inf (masked) logits keeps the sum at 0, not NaN.
        block_max = tl.max(x, axis=0)
        new_max = tl.maximum(run_max, block_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_max = new_max

        # 3. Rank: logits strictly above the sampled one.
        if RETURN_RANK:
            n_greater += (x > sampled_logit).to(tl.int32)

        # 4. Top-k: ids grow along the loop, so a block can only improve full slots with a
        # strictly greater value; most blocks are skipped on the max already computed.
        if HAS_TOPK:
            may_improve = (worst == _EMPTY_KEY) | (block_max > _key_value(worst))
            if may_improve:
                keys = tl.where(in_chunk, _sort_key(x, cols), _EMPTY_KEY)
                best = tl.max(keys, axis=0)
                while best > worst:
                    top = tl.where(slots == tl.argmin(top, axis=0), best, top)
                    keys = tl.where(keys == best, _EMPTY_KEY, keys)
                    best = tl.max(keys, axis=0)
                    worst = tl.min(top, axis=0)

    # 5. The chunk's partial results.
    part = row * n_splits + split
    tl.store(part_max_ptr + part, run_max)
    tl.store(part_sum_ptr + part, run_sum)
    if RETURN_RANK:
        tl.store(part_rank_ptr + part, tl.sum(n_greater, axis=0))
    if HAS_TOPK:
        tl.store(part_key_ptr + part * K_PAD + slots, top)


@triton.jit(do_not_specialize=["n_splits", "top_k"])
def _logprobs_merge_kernel(
    logits_ptr,
    stride_row,
    n_vocab,
    n_splits,
    top_k,
    sampled_ptr,
    token_ptr,
    row_offsets_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_rank_ptr,
    part_key_ptr,
    sampled_out_ptr,
    rank_out_ptr,
    top_ids_ptr,
    top_logprobs_ptr,
    token_out_ptr,
    HAS_TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RETURN_RANK: tl.constexpr,
    HAS_TOKENS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
):
    """Merge row `program_id(0)`'s partials and write its outputs.

    logits_ptr, stride_row, n_vocab, sampled_ptr, part_*_ptr: as in `_logprobs_kernel`.
    token_ptr: [N] int64 explicit ids; row_offsets_ptr: [B + 1] int64 offsets into them.
    sampled_out_ptr: [B] fp32; rank_out_ptr: [B] int64; top_ids_ptr: [B, top_k] int32;
    top_logprobs_ptr: [B, top_k] fp32; token_out_ptr: [N] fp32.
    HAS_TOKENS: explicit ids given; MAX_SPLITS: a power of two >= n_splits;
    BLOCK_TOKENS: explicit ids per loop step.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    splits = tl.arange(0, MAX_SPLITS)
    has_split = splits < n_splits
    part = row * n_splits + splits

    # 1. Row max and log(sum-exp) from the chunks'. Logprob = (x - row_max) - log_sum.
    chunk_max = tl.load(part_max_ptr + part, mask=has_split, other=float("-inf"))
    chunk_sum = tl.load(part_sum_ptr + part, mask=has_split, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    log_sum = tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - shift), axis=0))

    # 2. The sampled id and its rank.
    sid = tl.load(sampled_ptr + row)
    sid_ok = (sid >= 0) & (sid < n_vocab)
    x = tl.load(row_ptr + tl.where(sid_ok, sid, 0)).to(tl.float32)
    tl.store(sampled_out_ptr + row, tl.where(sid_ok, (x - row_max) - log_sum, float("-inf")))
    if RETURN_RANK:
        n_greater = tl.load(part_rank_ptr + part, mask=has_split, other=0)
        tl.store(rank_out_ptr + row, tl.sum(n_greater, axis=0).to(tl.int64) + 1)

    # 3. Top-k: the best of all chunks' keys, one max-reduction per rank. Keys are unique.
    if HAS_TOPK:
        slots = tl.arange(0, K_PAD)
        keys = tl.load(
            part_key_ptr + part[:, None] * K_PAD + slots[None, :],
            mask=has_split[:, None],
            other=_EMPTY_KEY,
        )
        top = tl.full((K_PAD,), _EMPTY_KEY, tl.int64)
        for rank in range(top_k):
            best = tl.max(tl.max(keys, axis=1), axis=0)
            top = tl.where(slots == rank, best, top)
            keys = tl.where(keys == best, _EMPTY_KEY, keys)
        out = row * top_k + slots
        tl.store(top_ids_ptr + out, _key_id(top), mask=slots < top_k)
        top_logprobs = (_key_value(top) - row_max) - log_sum
        tl.store(top_logprobs_ptr + out, top_logprobs, mask=slots < top_k)

    # 4. Explicit ids, ragged: this row's are token_ptr[row_offsets[row]:row_offsets[row + 1]].
    if HAS_TOKENS:
        lo = tl.load(row_offsets_ptr + row)
        hi = tl.load(row_offsets_ptr + row + 1)
        lanes = tl.arange(0, BLOCK_TOKENS)
        for block in range(lo, hi, BLOCK_TOKENS):
            idx = block + lanes
            in_row = idx < hi
            tid = tl.load(token_ptr + idx, mask=in_row, other=-1)
            tid_ok = (tid >= 0) & (tid < n_vocab)
            logit = tl.load(row_ptr + tid, mask=in_row & tid_ok, other=float("-inf"))
            logprob = tl.where(tid_ok, (logit.to(tl.float32) - row_max) - log_sum, float("-inf"))
            tl.store(token_out_ptr + idx, logprob, mask=in_row)


def _k_slots(top_k: int) -> int:
    """Top-k slots per program: two buckets, so k in 1..20 compiles two variants, not twenty."""
    return 8 if top_k <= 8 else 32


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the device: a few per SM on CUDA, a handful in the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def gather_logprobs_triton(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    return_rank: bool = False,
    *,
    n_splits: int | None = None,
    block_v: int = BLOCK_V,
) -> LogprobOutput:
    """`kernels.gather_logprobs` on the Triton kernels: two launches, no host synchronisation.

    `n_splits` (programs per row) and `block_v` (a power of two) override the launch shape,
    for tests; by default a row is split until B * S programs fill the device.
    """
    inputs = prepare_inputs(logits, sampled_ids, top_k, token_ids, row_offsets, return_rank)
    if logits.shape[0] == 0:
        return empty_output(inputs)
    # Triton launches on the current CUDA device, which need not be the logits'.
    on_device = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    with on_device:
        return _launch(inputs, n_splits, block_v)


def _launch(inputs: LogprobInputs, n_splits: int | None, block_v: int) -> LogprobOutput:
    """Size the grid and workspace, run both kernels, wrap the outputs."""
    logits, top_k, return_rank = inputs.logits, inputs.top_k, inputs.return_rank
    n_rows, n_vocab = logits.shape
    device = logits.device
    n_blocks = triton.cdiv(n_vocab, block_v)
    if n_splits is None:
        n_splits = triton.cdiv(_programs_wanted(device), n_rows)
    split_blocks = triton.cdiv(n_blocks, max(1, min(n_splits, n_blocks, MAX_SPLITS)))
    n_splits = triton.cdiv(n_blocks, split_blocks)
    k_slots = _k_slots(top_k)

    def buffer(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    part_max = buffer(torch.float32, n_rows, n_splits)
    part_sum = buffer(torch.float32, n_rows, n_splits)
    # Unused outputs point at a real buffer: the kernels never touch them behind their flag.
    part_rank = buffer(torch.int32, n_rows, n_splits) if return_rank else part_max
    part_keys = buffer(torch.int64, n_rows, n_splits, k_slots) if top_k else part_max
    _logprobs_kernel[(n_rows, n_splits)](
        logits,
        logits.stride(0),
        n_vocab,
        split_blocks,
        n_splits,
        inputs.sampled_ids,
        part_max,
        part_sum,
        part_rank,
        part_keys,
        HAS_TOPK=top_k > 0,
        K_PAD=k_slots,
        RETURN_RANK=return_rank,
        BLOCK_V=block_v,
        num_warps=NUM_WARPS,
    )

    sampled_logprobs = buffer(torch.float32, n_rows)
    ranks = buffer(torch.int64, n_rows) if return_rank else None
    top_ids = buffer(torch.int32, n_rows, top_k)
    top_logprobs = buffer(torch.float32, n_rows, top_k)
    has_tokens = inputs.token_ids is not None
    tokens = buffer(torch.float32, *inputs.token_shape) if has_tokens else None
    _logprobs_merge_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        n_vocab,
        n_splits,
        top_k,
        inputs.sampled_ids,
        inputs.token_ids if has_tokens else inputs.sampled_ids,
        inputs.row_offsets if has_tokens else inputs.sampled_ids,
        part_max,
        part_sum,
        part_rank,
        part_keys,
        sampled_logprobs,
        sampled_logprobs if ranks is None else ranks,
        top_ids if top_k else sampled_logprobs,
        top_logprobs if top_k else sampled_logprobs,
        tokens if has_tokens else sampled_logprobs,
        HAS_TOPK=top_k > 0,
        K_PAD=k_slots,
        RETURN_RANK=return_rank,
        HAS_TOKENS=has_tokens,
        MAX_SPLITS=MAX_SPLITS,
        BLOCK_TOKENS=BLOCK_TOKENS,
        num_warps=MERGE_NUM_WARPS,
    )
    return LogprobOutput(
        sampled_logprobs=sampled_logprobs,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        token_logprobs=empty_token_logprobs(inputs) if tokens is None else tokens,
        sampled_ranks=ranks,
    )


def warmup(
    device: torch.device | str,
    dtypes: Iterable[torch.dtype],
    vocab_size: int,
    top_ks: Iterable[int] = (0, 1, 20),
    return_ranks: Iterable[bool] = (False, True),
) -> list[tuple[torch.dtype, int, bool, bool]]:
    """Compile, before serving, every kernel variant a decode step can pick; returns the
    (dtype, top_k, return_rank, explicit ids) launches it made.

    Per logits dtype: 6 variants of step 1 (top-k bucket none / <= 8 / <= 20, rank or not) and
    12 of the merge (the same, with or without explicit ids). `top_ks` and `return_ranks` may
    narrow them to what the server allows.
    `vocab_size` must be the model's, as Triton specialises V and the row stride on their
    divisibility by 16. Compiled kernels also land in Triton's on-disk cache for later starts.
    """
    device = torch.device(device)
    if device.type == "cpu" and not INTERPRET:
        return []  # CPU tensors take the torch path, which compiles nothing
    sampled = torch.zeros(2, dtype=torch.int64, device=device)
    token_ids = torch.zeros(2, 1, dtype=torch.int64, device=device)
    launches = []
    for dtype in dtypes:
        logits = torch.zeros(2, vocab_size, dtype=dtype, device=device)
        for top_k in top_ks:
            for return_rank in return_ranks:
                for tokens in (None, token_ids):
                    gather_logprobs_triton(logits, sampled, top_k, tokens, None, return_rank)
                    launches.append((dtype, top_k, return_rank, tokens is not None))
    return launches
