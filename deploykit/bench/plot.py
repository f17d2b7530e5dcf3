"""The PNG of a bench run (or a sweep, or several runs): output throughput and p99 time to first token against
concurrency, one line per series. matplotlib is an optional extra (`pip install 'deploykit[plot]'`)."""

from __future__ import annotations

from ..errors import OutputError


def series(doc: dict) -> list[tuple[int, float | None, float | None]]:
    """(concurrency, output tok/s, p99 TTFT in ms) per level of a bench document."""
    return [(lv["concurrency"], lv["output_tokens_per_s"],
             None if lv["ttft_s"]["p99"] is None else lv["ttft_s"]["p99"] * 1000) for lv in doc["levels"]]


def write(lines: dict[str, list[tuple[int, float | None, float | None]]], path: str, title: str) -> None:
    """lines: label -> [(concurrency, tok/s, p99 TTFT ms)]."""
    try:
        import matplotlib
    except ImportError:
        raise OutputError("--plot needs matplotlib", path=path, hint="pip install 'deploykit[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for label, points in lines.items():
        xs = [c for c, _, _ in points]
        tput.plot(xs, [t for _, t, _ in points], marker="o", label=label)
        ttft.plot(xs, [f for _, _, f in points], marker="o", label=label)
    levels = sorted({c for points in lines.values() for c, _, _ in points})
    for ax, ylabel in ((tput, "output tokens/s"), (ttft, "p99 time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    if len(lines) > 1:
        tput.legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise OutputError(f"cannot write the plot: {e.strerror or e}", path=path) from None
    finally:
        plt.close(fig)
