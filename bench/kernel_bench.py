"""Benchmark `gather_logprobs` against the naive log_softmax + gather + topk, side by side.

    python -m bench.kernel_bench   # CUDA if present (Triton kernels), else CPU (torch path)

It first checks both against the float64 reference, then prints, per shape, the median time,
the bandwidth against the B * V logits bytes (the floor: every logit read once), the naive
path's, and the ratio. The copy line is the device's measured read+write bandwidth, the
ceiling the kernel's GB/s is a percentage of.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import gather_logprobs
from kernels.logprobs import INTERPRET
from tests.kernels.reference import reference_logprobs

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def naive_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    top_k: int,
    token_ids: torch.Tensor,
    row_offsets: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """What serving code usually does: a full [B, V] fp32 log-softmax, then gathers."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sampled = logprobs.gather(1, sampled_ids[:, None])
    top = logprobs.topk(top_k, dim=-1)
    rows = torch.repeat_interleave(
        torch.arange(logits.shape[0], device=logits.device),
        row_offsets.diff(),
        output_size=token_ids.numel(),
    )
    return sampled, top.values, top.indices, logprobs[rows, token_ids]


def make_inputs(
    n_rows: int, n_vocab: int, dtype: torch.dtype, ids_per_row: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = (torch.randn(n_rows, n_vocab, device=device) * 4).to(dtype)
    sampled = torch.randint(0, n_vocab, (n_rows,), device=device)
    token_ids = torch.randint(0, n_vocab, (n_rows * ids_per_row,), device=device)
    offsets = torch.arange(n_rows + 1, device=device) * ids_per_row
    return logits, sampled, token_ids, offsets


class Timer:
    """Median times of callables run in turn, so that a noisy machine slows them alike.

    On CUDA, events around each run with the L2 cache flushed before it (small shapes are not
    timed from cache); on CPU, perf_counter.
    """

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.flush = (
            torch.empty(256 << 20, dtype=torch.int8, device=device)
            if device.type == "cuda"
            else None
        )

    def __call__(self, *fns: Callable[[], object]) -> list[float]:
        for _ in range(self.warmup):
            for fn in fns:
                fn()
        if self.flush is None:
            times: list[list[float]] = [[] for _ in fns]
            for _ in range(self.iters):
                for fn, fn_times in zip(fns, times, strict=True):
                    began = time.perf_counter()
                    fn()
                    fn_times.append(time.perf_counter() - began)
            return [statistics.median(fn_times) for fn_times in times]
        events = [
            [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in fns
            ]
            for _ in range(self.iters)
        ]
        for round_events in events:
            for fn, (start, end) in zip(fns, round_events, strict=True):
                self.flush.zero_()
                start.record()
                fn()
                end.record()
        torch.cuda.synchronize(self.device)
        return [
            statistics.median(
                round_events[i][0].elapsed_time(round_events[i][1]) for round_events in events
            )
            / 1e3
            for i in range(len(fns))
        ]


def copy_bandwidth(timer: Timer, n_bytes: int) -> float:
    """Bytes per second of a plain tensor copy (read + write), the practical memory ceiling."""
    src = torch.empty(n_bytes, dtype=torch.int8, device=timer.device).random_()
    dst = torch.empty_like(src)
    (seconds,) = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / seconds


def check(device: torch.device, top_k: int, ids_per_row: int) -> None:
    """Both paths against the float64 reference before anything is timed.

    The naive path gets a looser bound: torch's fused fp32 log_softmax errs by about 1.5e-5.
    """
    for dtype in (torch.bfloat16, torch.float32):
        logits, sampled, token_ids, offsets = make_inputs(8, 32003, dtype, ids_per_row, device)
        cpu = [t.cpu() for t in (logits, sampled, token_ids, offsets)]
        ref = reference_logprobs(cpu[0], cpu[1], top_k, cpu[2], cpu[3])
        out = gather_logprobs(logits, sampled, top_k, token_ids, offsets)
        naive = naive_logprobs(logits, sampled, top_k, token_ids, offsets)
        checks = [
            (out.sampled_logprobs, ref.sampled_logprobs, 1e-5),
            (out.top_logprobs, ref.top_logprobs, 1e-5),
            (out.token_logprobs, ref.token_logprobs, 1e-5),
            (naive[0].squeeze(1), ref.sampled_logprobs, 1e-4),
            (naive[1], ref.top_logprobs, 1e-4),
            (naive[3], ref.token_logprobs, 1e-4),
        ]
        for actual, expected, atol in checks:
            torch.testing.assert_close(actual.cpu().double(), expected, atol=atol, rtol=0)
        assert torch.equal(out.top_ids.cpu(), ref.top_ids)
    print("check: ours within 1e-5 of the float64 reference, naive within 1e-4")


@dataclass(frozen=True)
class Row:
    """One table row: the two paths' median seconds on one shape, against the copy ceiling."""

    dtype: str
    n_rows: int
    n_vocab: int
    ours_s: float
    naive_s: float
    logits_bytes: int
    copy_bytes_per_s: float

    def copy_fraction(self, seconds: float) -> float:
        return self.logits_bytes / seconds / self.copy_bytes_per_s

    @property
    def speedup(self) -> float:
        return self.naive_s / self.ours_s

    def format(self) -> str:
        cells = []
        for seconds in (self.ours_s, self.naive_s):
            rate = self.logits_bytes / seconds
            cells.append(
                f"{seconds * 1e6:9.1f} {rate / 1e9:7.1f} {100 * self.copy_fraction(seconds):5.1f}%"
            )
        return (
            f"{self.dtype:>5} {self.n_rows:>4} {self.n_vocab:>7} | {cells[0]} | {cells[1]} | "
            f"{self.speedup:6.2f}x"
        )


def bench_shape(
    timer: Timer,
    copy: float,
    dtype_name: str,
    n_rows: int,
    n_vocab: int,
    top_k: int,
    ids_per_row: int,
) -> Row:
    """Ours and naive on one shape, timed in turn."""
    logits, sampled, token_ids, offsets = make_inputs(
        n_rows, n_vocab, _DTYPES[dtype_name], ids_per_row, timer.device
    )
    ours, naive = timer(
        lambda: gather_logprobs(logits, sampled, top_k, token_ids, offsets),
        lambda: naive_logprobs(logits, sampled, top_k, token_ids, offsets),
    )
    n_bytes = logits.numel() * logits.element_size()
    return Row(dtype_name, n_rows, n_vocab, ours, naive, n_bytes, copy)


def main(argv: list[str] | None = None) -> list[Row]:
    """Print the check, the copy line and the table; return the table's rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--vocab-sizes", type=int, nargs="+")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(_DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--ids-per-row", type=int, default=16, help="explicit ids per row")
    parser.add_argument("--iters", type=int, help="timed runs per shape (median)")
    parser.add_argument(
        "--threads", type=int, help="CPU threads for torch (on a busy machine, 1 is steadier)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    # The CPU defaults stay small enough for about a minute on two cores.
    batch_sizes = args.batch_sizes or ([1, 8, 64, 256] if on_cuda else [1, 8, 64])
    vocab_sizes = args.vocab_sizes or (
        [32000, 128256, 151936, 262144] if on_cuda else [32000, 128256]
    )
    timer = Timer(device, args.iters or (100 if on_cuda else 15), warmup=10 if on_cuda else 2)
    torch.manual_seed(0)

    check(device, args.top_k, args.ids_per_row)
    copy = copy_bandwidth(timer, (1 << 30) if on_cuda else (256 << 20))
    name = (
        torch.cuda.get_device_name(device) if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    )
    path = "Triton kernels" if on_cuda or INTERPRET else "torch path"
    print(f"device: {name}; ours: {path}; top_k={args.top_k}, {args.ids_per_row} ids/row")
    print(f"copy bandwidth (read + write): {copy / 1e9:.1f} GB/s")
    header = (
        f"{'dtype':>5} {'B':>4} {'V':>7} | {'ours us':>9} {'GB/s':>7} {'%copy':>6} | "
        f"{'naive us':>9} {'GB/s':>7} {'%copy':>6} | {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for dtype_name in args.dtypes:
        for n_rows in batch_sizes:
            for n_vocab in vocab_sizes:
                row = bench_shape(
                    timer, copy, dtype_name, n_rows, n_vocab, args.top_k, args.ids_per_row
                )
                print(row.format(), flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
