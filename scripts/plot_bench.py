#!/usr/bin/env python3
"""Plots `moeinfer bench` JSON: fraction of the binding floor (the bandwidth floor, or the compute
floor where that is larger) against N, one panel per preset, one line per format and routing;
compute-bound points are squares.   plot_bench.py bench.json bench.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    rows = data["rows"]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 4.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        keys = list(dict.fromkeys((r["format"], r["routing"]) for r in rows if r["preset"] == preset))
        for fmt, routing in keys:
            # JSON from before the compute floor has no compute_fraction: its rows are all the bandwidth's.
            pts = sorted((r["tokens"], max(r["fraction"], r.get("compute_fraction", 0.0)), r.get("bound") == "compute")
                         for r in rows if r["preset"] == preset and r["format"] == fmt and r["routing"] == routing)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linestyle="-" if routing == "independent" else "--", label="%s, %s" % (fmt, routing))
            compute = [p for p in pts if p[2]]
            if compute:
                ax.plot([p[0] for p in compute], [p[1] for p in compute], marker="s", markersize=9, linestyle="none",
                        markerfacecolor="none", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(preset)
        ax.set_xlabel("tokens per call (N)")
        ax.set_ylabel("fraction of the binding floor (squares: compute)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    peak = data.get("peak_gflops", 0.0)
    title = "moeinfer bench on %s\nread bandwidth %.0f GB/s" % (data["device"], data["read_gbps"])
    if peak > 0:
        title += ", compute peak %.0f %s" % ((peak / 1e3, "TFLOP/s") if peak >= 1e4 else (peak, "GFLOP/s"))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
