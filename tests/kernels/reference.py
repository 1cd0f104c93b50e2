"""The float64 yardstick the kernel tests and the kernel benchmark compare `gather_logprobs`
with: the plainest ops (full log-softmax, full stable sort), slow and memory-hungry by design."""

from __future__ import annotations

import torch

from kernels.common import LogprobOutput, prepare_inputs


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
    if inputs.token_ids is None or inputs.row_offsets is None:
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
