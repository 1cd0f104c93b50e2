"""Output tok/s and p50 time to first token against concurrency, one line per scenario."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench.loadgen import Summary

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot(summaries: Sequence[Summary], path: Path) -> None:
    """Writes `figure(summaries)` as a PNG."""
    drawn = figure(summaries)
    import matplotlib.pyplot as plt  # after `figure` has chosen the headless backend

    path.parent.mkdir(parents=True, exist_ok=True)
    drawn.savefig(path, dpi=110)
    plt.close(drawn)


def figure(summaries: Sequence[Summary]) -> Figure:
    """Two panels; a scenario measured at one concurrency only is a point. Each scenario has a
    colour of its own: the default cycle's ten, then Dark2's eight (a sweep draws twelve)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the benchmark runs headless
    import matplotlib.pyplot as plt

    series: dict[str, list[Summary]] = defaultdict(list)
    for summary in summaries:
        series[summary.target].append(summary)
    colours = [
        tuple(rgba)
        for rgba in (*plt.get_cmap("tab10")(range(10)), *plt.get_cmap("Dark2")(range(8)))
    ]
    drawn, (rate, ttft) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    for index, (name, runs) in enumerate(series.items()):
        runs.sort(key=lambda run: run.concurrency)
        concurrency = [run.concurrency for run in runs]
        style = "-o" if name.startswith("ours") else "--s"
        colour = colours[index % len(colours)]
        rate.plot(
            concurrency, [run.output_tokens_per_s for run in runs], style, color=colour, label=name
        )
        ttft.plot(
            concurrency, [1e3 * run.ttft_p50 for run in runs], style, color=colour, label=name
        )
    swept = sorted({summary.concurrency for summary in summaries})
    for axes, label in ((rate, "output tokens / s"), (ttft, "p50 time to first token, ms")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(swept, [str(c) for c in swept])
        axes.set_xlabel("concurrent requests")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
    ttft.set_yscale("log")
    rate.legend(fontsize="small")
    return drawn
