"""Output tok/s and p50 time to first token against concurrency, one line per scenario."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from bench.loadgen import Summary


def plot(summaries: Sequence[Summary], path: Path) -> None:
    """Writes a PNG of two panels; a scenario measured at one concurrency only is a point."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the benchmark runs headless
    import matplotlib.pyplot as plt

    series: dict[str, list[Summary]] = defaultdict(list)
    for summary in summaries:
        series[summary.target].append(summary)
    figure, (rate, ttft) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    for name, runs in series.items():
        runs.sort(key=lambda run: run.concurrency)
        concurrency = [run.concurrency for run in runs]
        style = "-o" if name.startswith("ours") else "--s"
        rate.plot(concurrency, [run.output_tokens_per_s for run in runs], style, label=name)
        ttft.plot(concurrency, [1e3 * run.ttft_p50 for run in runs], style, label=name)
    swept = sorted({summary.concurrency for summary in summaries})
    for axes, label in ((rate, "output tokens / s"), (ttft, "p50 time to first token, ms")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(swept, [str(c) for c in swept])
        axes.set_xlabel("concurrent requests")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
    ttft.set_yscale("log")
    rate.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
