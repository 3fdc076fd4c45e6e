"""Plots of `specrun eval` results, and `specrun eval-plot` to draw JSON lines recorded elsewhere.

One PNG, two panels: left, the accepted-length histogram of every (tree shape, temperature)
point as the fraction of rounds that accepted 0, 1, ... D draft tokens; right, the mean
accepted length (tokens per round) by tree shape, one line per temperature (and per file, for
`eval-plot` of several files), each point
labelled with its end-to-end speed-up over plain decoding. matplotlib is optional
(`pip install 'specrun[plot]'`); a GPU machine without it writes `--json` and the plot is
drawn elsewhere with `specrun eval-plot FILE.jsonl --out FILE.png`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval-plot", help="draw `specrun eval --json` results")
    parser.add_argument("results", nargs="+", help="JSON-lines files written by eval --json")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_plotting()
    records = []
    for path in args.results:
        text = Path(path).read_text()
        run_records = [json.loads(line) for line in text.splitlines() if line.strip()]
        if len(args.results) > 1:  # tell the files' points apart
            run_records = [{**record, "run": Path(path).stem} for record in run_records]
        records.extend(run_records)
    if not records:
        raise ValueError(f"no eval records in {', '.join(args.results)}")
    plot_records(records, args.out)
    print(f"wrote {args.out} ({len(records)} points)")
    return 0


def check_plotting() -> None:
    """Raise ValueError (what to install) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "plots need matplotlib: pip install 'specrun[plot]' (or write --json here and draw "
            "it elsewhere with `specrun eval-plot FILE.jsonl --out FILE.png`)"
        ) from None


def tree_label(record: dict) -> str:
    """'D,K,N', with ',s' for a stochastic tree; an adaptive policy's name before it (its
    ladder starts at that tree)."""
    suffix = ",s" if record.get("stochastic") else ""
    policy = record.get("policy", "fixed")
    prefix = "" if policy == "fixed" else f"{policy} "
    return f"{prefix}{record['depth']},{record['topk']},{record['nodes']}{suffix}"


def series_label(record: dict) -> str:
    """The line a point belongs to: its temperature, and its file's name when several files
    are drawn together (eval-plot sets `run`)."""
    run = f"{record['run']}, " if "run" in record else ""
    return f"{run}T={record['temperature']:g}"


def plot_records(records: list[dict], path: str | Path) -> None:
    """Draw eval records (dicts as `specrun eval --json` writes them) into the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist_ax, shape_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    _draw_histograms(hist_ax, records)
    _draw_by_shape(shape_ax, records)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_histograms(ax, records: list[dict]) -> None:
    width = 0.8 / len(records)
    for index, record in enumerate(records):
        counts = record["accepted_histogram"]
        total = max(sum(counts), 1)
        offsets = [k - 0.4 + (index + 0.5) * width for k in range(len(counts))]
        label = f"tree {tree_label(record)}, {series_label(record)}"
        ax.bar(offsets, [c / total for c in counts], width=width, label=label)
    ax.set_xticks(range(max(len(r["accepted_histogram"]) for r in records)))
    ax.set_xlabel("draft tokens accepted in a round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("accepted-length histogram")
    ax.legend(fontsize="small")


def _draw_by_shape(ax, records: list[dict]) -> None:
    """Accepted length by tree, for the trees run fixed."""
    records = [r for r in records if r.get("policy", "fixed") == "fixed"]
    by_size = sorted({(r["depth"], r["topk"], r["nodes"]) for r in records})
    shapes = [",".join(map(str, shape)) for shape in by_size]

    def size_index(record: dict) -> int:
        return by_size.index((record["depth"], record["topk"], record["nodes"]))

    for series in dict.fromkeys(series_label(r) for r in records):
        points = sorted((r for r in records if series_label(r) == series), key=size_index)
        xs = [size_index(r) for r in points]
        ys = [r["mean_accepted_length"] for r in points]
        ax.plot(xs, ys, marker="o", label=series)
        for x, y, r in zip(xs, ys, points, strict=True):
            if "speedup" in r:
                ax.annotate(
                    f"{r['speedup']:.2f}x", (x, y), textcoords="offset points", xytext=(0, 6)
                )
    ax.set_xticks(range(len(shapes)), [f"({s})" for s in shapes])
    ax.set_xlabel("tree (depth, top-k, nodes)")
    ax.set_ylabel("mean accepted length (tokens per round)")
    ax.set_title("accepted length by tree shape (labels: speed-up)")
    ax.legend()
