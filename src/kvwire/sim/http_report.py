"""The PNG of an HTTP replay per policy (``kvwire demo``): matplotlib, Agg backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .http_replay import ReplayRecord, ReplaySummary
from .report import color, pyplot, save_figure, ttft_cdf

__all__ = ["write_http_report"]


def write_http_report(runs: Mapping[str, tuple[ReplaySummary, Sequence[ReplayRecord]]],
                      path: str | Path, title: str = "") -> Path:
    """Four panels: cached-token ratio, client TTFT p50/p99, work per engine, TTFT CDF."""
    plt = pyplot()

    path = Path(path)
    names = list(runs)
    sums = [runs[n][0] for n in names]
    colors = [color(n) for n in names]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=100)
    fig.suptitle(title or "kvwire: trace replayed over HTTP", fontsize=14)

    ax = axes[0][0]
    bars = ax.bar(names, [s.cached_ratio for s in sums], color=colors)
    ax.bar_label(bars, fmt="%.3f")
    ax.set_title("cached prompt tokens, as the engines reported (higher is better)")
    ax.set_ylim(0, max(1e-9, max(s.cached_ratio for s in sums)) * 1.2)

    ax = axes[0][1]
    x = range(len(names))
    w = 0.38
    b1 = ax.bar([i - w / 2 for i in x], [s.ttft_p50_s * 1e3 for s in sums], w, color=colors,
                alpha=0.55, label="p50")
    b2 = ax.bar([i + w / 2 for i in x], [s.ttft_p99_s * 1e3 for s in sums], w, color=colors,
                label="p99")
    ax.bar_label(b1, fmt="%.0f", fontsize=8)
    ax.bar_label(b2, fmt="%.0f", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_title("client-measured TTFT, ms (p50 light, p99 dark; lower is better)")

    ax = axes[1][0]
    engines = sorted({e for s in sums for e in s.engine_work},
                     key=lambda e: (len(e), e))
    width = 0.8 / max(1, len(names))
    for k, (n, s) in enumerate(zip(names, sums)):
        ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(engines))],
               [s.engine_work.get(e, 0.0) for e in engines], width,
               color=color(n),
               label=f"{n} (max/mean {s.work_max_over_mean:.2f})")
    ax.set_xticks(range(len(engines)), [e.replace("engine", "e") for e in engines])
    ax.set_ylabel("model seconds")
    ax.set_title("work per engine (uncached prefill + decode)")
    top = max((max(s.engine_work.values(), default=0.0) for s in sums), default=1.0)
    ax.set_ylim(0, max(top, 1e-9) * 1.35)
    ax.legend(fontsize=8, loc="upper center", ncol=2)

    ttft_cdf(axes[1][1], [(n, [r.ttft_s * 1e3 for r in runs[n][1]
                               if r.ok and r.ttft_s is not None]) for n in names], "ms")
    return save_figure(fig, path)
