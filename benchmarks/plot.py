"""Plot the link-rate table of ``benchmarks/link_rates.py`` as a PNG.

Two panels, one group of bars per link rate (fastest first, the calibrated rate marked) and
one bar per compression: images/s per rank (with the 95% CI over iterations as an error bar
when the run had at least 3 iterations), and the communication share of step time (the
exposed ``synchronize()`` wait over the step), with the issue-4 lines at 35% (dense at the
calibrated rate must reach it) and 12% (top-k at 1 Gbit/s must stay under it)::

    python benchmarks/plot.py out/link_rates.json -o out/link_rates.png

Needs matplotlib (imported only when plotting, so nothing else in hvps depends on it):
``pip install matplotlib``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

COLORS = {"none": "#4c72b0", "fp16": "#dd8452", "bf16": "#c44e52", "int8": "#8172b3", "topk": "#55a868",
          "dgc": "#937860"}


def groups(table: list[dict[str, Any]]) -> tuple[list[tuple[str, str]], list[str]]:
    """(rate, label) groups, fastest first, and the compressions in first-seen order."""
    keys: dict[tuple[str, str], float] = {}
    comps: list[str] = []
    for row in table:
        keys.setdefault((row["rate"], row["label"]), row.get("rate_bits") or 0.0)
        if row["compression"] not in comps:
            comps.append(row["compression"])
    order = sorted(keys, key=lambda k: (-keys[k], k[1] == "calibrated"))
    return order, comps


def plot(report: dict[str, Any], out: Path, dpi: int = 120) -> Path:
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot.py: needs matplotlib (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = report["table"]
    if not table:
        sys.exit("plot.py: the JSON has an empty table")
    order, comps = groups(table)
    s = report.get("settings", {})
    width = 0.8 / len(comps)
    with_ci = (s.get("num_iters") or 0) >= 3  # a t interval over 2 iterations says nothing
    fig, (ax_img, ax_comm) = plt.subplots(1, 2, figsize=(12, 4.8))

    def row_for(key: tuple[str, str], comp: str) -> Optional[dict[str, Any]]:
        hits = [r for r in table if (r["rate"], r["label"]) == key and r["compression"] == comp]
        return hits[-1] if hits else None

    for j, comp in enumerate(comps):
        xs, img, err, share = [], [], [], []
        for i, key in enumerate(order):
            r = row_for(key, comp)
            if r is None:
                continue
            xs.append(i + (j - (len(comps) - 1) / 2) * width)
            img.append(r["img_s_per_rank"])
            err.append((r.get("img_s_per_rank_ci_half_width") or 0.0) if with_ci else 0.0)
            share.append(100 * r["comm_share"])
        label = comp + (f" (density {s.get('density', 0.01):g})"
                        if comp in ("topk", "dgc") else "")
        color = COLORS.get(comp)
        bars = ax_img.bar(xs, img, width, yerr=err if any(err) else None, capsize=3, label=label, color=color)
        ax_img.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
        bars = ax_comm.bar(xs, share, width, label=label, color=color)
        ax_comm.bar_label(bars, fmt="%.0f%%", fontsize=8, padding=2)

    ticks = []
    for rate, label in order:
        tcp = report.get("links", {}).get(rate, {}).get("tcp_bytes_per_s")
        text = rate + ("\n(calibrated)" if label == "calibrated" else "")
        ticks.append(text + (f"\nTCP {tcp / 1e6:.0f} MB/s" if tcp else ""))
    for ax in (ax_img, ax_comm):
        ax.set_xticks(range(len(order)), ticks)
        ax.set_xlabel("link rate (tc tbf per host)")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    ax_img.set_ylabel("images/s per rank")
    ax_img.set_title("Throughput")
    ax_img.set_ylim(0, ax_img.get_ylim()[1] * 1.12)
    ax_comm.set_ylabel("communication share of step time (%)")
    ax_comm.set_title("Exposed communication wait / step time")
    ax_comm.axhline(35, color="#444", ls="--", lw=1, label="target: dense >= 35% at the calibrated rate")
    ax_comm.axhline(12, color="#444", ls=":", lw=1, label="target: top-k <= 12% at 1gbit")
    ax_comm.set_ylim(0, max(100, ax_comm.get_ylim()[1]))
    ax_comm.legend(fontsize=8, loc="upper left")
    ax_img.legend(fontsize=8, loc="upper right")
    title = (f"ResNet-50, 2 emulated hosts x 1 rank (TCP), batch {s.get('batch_size')}, "
             f"{s.get('image_size')} px, {s.get('num_iters')} x {s.get('num_batches_per_iter')} batches, "
             f"{s.get('threads_per_rank')} thread/rank")
    if s.get("quick"):
        title += "\nSMOKE RUN (--quick): not a measurement"
    fig.suptitle(title, fontsize=10, color="#b00" if s.get("quick") else "black")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="the JSON that benchmarks/link_rates.py wrote")
    p.add_argument("-o", "--output", default="",
                   help="PNG to write (default: the JSON's path with .png instead of .json)")
    p.add_argument("--dpi", type=int, default=120, help="resolution (default: %(default)s)")
    args = p.parse_args(argv)
    src = Path(args.json)
    report = json.loads(src.read_text())
    if report.get("benchmark") != "link_rates":
        sys.exit(f"plot.py: {src} is not a benchmarks/link_rates.py result")
    out = plot(report, Path(args.output) if args.output else src.with_suffix(".png"), args.dpi)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
