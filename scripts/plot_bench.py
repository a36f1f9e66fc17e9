#!/usr/bin/env python3
"""Plots `moeinfer bench` JSON: fraction of the bandwidth floor against N, one panel per preset,
one line per format and routing.   plot_bench.py bench.json bench.png"""
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
            pts = sorted((r["tokens"], r["fraction"]) for r in rows
                         if r["preset"] == preset and r["format"] == fmt and r["routing"] == routing)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if routing == "independent" else "--", label="%s, %s" % (fmt, routing))
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(preset)
        ax.set_xlabel("tokens per call (N)")
        ax.set_ylabel("fraction of the bandwidth floor")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("moeinfer bench on %s (read bandwidth %.0f GB/s)" % (data["device"], data["read_gbps"]))
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
