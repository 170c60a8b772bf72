"""The simulator's PNG report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .types import SimResult

__all__ = ["ReportUnavailable", "write_report"]


class ReportUnavailable(RuntimeError):
    """The PNG needs matplotlib, an optional dependency (``pip install 'kvwire[sim]'``)."""

_COLORS = {"kvwire": "#1b9e77", "oracle": "#7570b3", "random": "#999999",
           "round_robin": "#e6ab02", "least_load": "#d95f02"}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; ReportUnavailable naming the extra if
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise ReportUnavailable(
            f"no PNG report: matplotlib is not installed ({e}); "
            "pip install 'kvwire[sim]' for it") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def color(name: str) -> str:
    """A policy's color in every chart."""
    return _COLORS.get(name, "#444444")


def write_report(result: SimResult, path: str | Path) -> Path:
    """Four panels: hit ratio per policy, TTFT p50/p99 per policy, per-engine work, TTFT CDF."""
    plt = pyplot()

    path = Path(path)
    names = list(result.results)
    res = [result.results[n] for n in names]
    sums = [r.summary() for r in res]
    colors = [color(n) for n in names]
    cfg = result.config
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=100)
    fig.suptitle(
        f"kvwire sim: {result.requests} requests, {fleet(cfg)} engines x {cfg.capacity} "
        f"blocks of {cfg.block_tokens} tokens", fontsize=14)

    ax = axes[0][0]
    bars = ax.bar(names, [s["hit_ratio"] for s in sums], color=colors)
    ax.bar_label(bars, fmt="%.3f")
    ax.set_title("prefix cache hit ratio (higher is better)")
    ax.set_ylim(0, max(1e-9, max(s["hit_ratio"] for s in sums)) * 1.2)

    ax = axes[0][1]
    x = range(len(names))
    w = 0.38
    b1 = ax.bar([i - w / 2 for i in x], [s["ttft_p50_s"] for s in sums], w, color=colors,
                alpha=0.55, label="p50")
    b2 = ax.bar([i + w / 2 for i in x], [s["ttft_p99_s"] for s in sums], w, color=colors,
                label="p99")
    ax.bar_label(b1, fmt="%.2f", fontsize=8)
    ax.bar_label(b2, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_title("time to first token, s (p50 light, p99 dark; lower is better)")

    ax = axes[1][0]
    n_eng = cfg.fleet_size
    width = 0.8 / max(1, len(names))
    for k, (n, r) in enumerate(zip(names, res)):
        ax.bar([e + (k - (len(names) - 1) / 2) * width for e in range(n_eng)], r.engine_work_s,
               width, color=color(n),
               label=f"{n} (max/mean {r.work_max_over_mean:.2f})")
    ax.set_xticks(range(n_eng), [f"e{e}" for e in range(n_eng)])
    ax.set_ylabel("busy time, s")
    ax.set_title("work per engine (prefill + decode)")
    top = max((max(r.engine_work_s) for r in res if r.engine_work_s), default=1.0)
    ax.set_ylim(0, top * 1.35)
    ax.legend(fontsize=8, loc="upper center", ncol=2)

    ttft_cdf(axes[1][1], [(n, r.ttft_s) for n, r in zip(names, res)], "s")
    return save_figure(fig, path)


def ttft_cdf(ax: object, series: list[tuple[str, list[float]]], unit: str) -> None:
    """The reports' TTFT CDF panel: one line per policy (log x), kvwire thick."""
    for n, values in series:
        t = sorted(values)
        if not t:
            continue
        ys = [(i + 1) / len(t) for i in range(len(t))]
        # kvwire and the oracle often coincide: kvwire drawn thick, the oracle dashed on top.
        ax.plot([max(v, 1e-3) for v in t], ys, color=color(n), label=n,
                linewidth=3.0 if n == "kvwire" else 1.5,
                linestyle="--" if n == "oracle" else "-", zorder=3 if n == "oracle" else 2)
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT, {unit} (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF (left and high is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def save_figure(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def fleet(cfg) -> str:
    """The fleet's shape for a title: ``8``, or ``4 prefill + 2 decode``."""
    if not cfg.pd:
        return str(cfg.engines)
    parts = [f"{n} {role}" for n, role in ((cfg.prefill, "prefill"), (cfg.decode, "decode"),
                                           (cfg.engines, "both")) if n]
    return " + ".join(parts)
