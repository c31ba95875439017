"""Draw the ring schedule of context-parallel attention: docs/figures/cp_ring_schedule.png.

    python docs/figures/cp_ring_schedule.py [--cp 4] [--out docs/figures/cp_ring_schedule.png]

One panel per ring step. In each, the (query chunk, key chunk) grid of one sequence cut into
2 x cp chunks (rank r holds chunks r and 2cp-1-r); the 4 cells each rank meets at that step
carry the rank's number, coloured by what it computes there: the whole block (keys before the
queries), the causal diagonal, or nothing (keys after the queries: skipped). The schedule is the
trainer's own (trainer.parallel.ring_attention.schedule).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Polygon, Rectangle  # noqa: E402

from trainer.parallel.ring_attention import ring_source, schedule  # noqa: E402

COLOURS = {"full": "#4c72b0", "causal": "#dd8452", "skip": "#e6e6e6"}


def draw(cp: int, out: Path) -> None:
    chunks = 2 * cp
    fig, axes = plt.subplots(1, cp, figsize=(3.3 * cp, 3.9), constrained_layout=True)
    for step, ax in enumerate(axes):
        for rank in range(cp):
            for query, key, kind in schedule(rank, cp)[step]:
                x, y = key, query
                if kind == "causal":  # the lower triangle of the block: keys at or before the query
                    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=COLOURS["skip"], edgecolor="white"))
                    ax.add_patch(Polygon([(x, y), (x, y + 1), (x + 1, y + 1)], facecolor=COLOURS["causal"],
                                         edgecolor="white"))
                else:
                    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=COLOURS[kind], edgecolor="white",
                                           hatch="//" if kind == "skip" else None))
                ax.text(x + 0.5, y + 0.5, f"r{rank}", ha="center", va="center", fontsize=8,
                        color="black" if kind == "skip" else "white")
        ax.set_xlim(0, chunks)
        ax.set_ylim(chunks, 0)
        ax.set_aspect("equal")
        ax.set_xticks([i + 0.5 for i in range(chunks)], [str(i) for i in range(chunks)], fontsize=8)
        ax.set_yticks([i + 0.5 for i in range(chunks)], [str(i) for i in range(chunks)], fontsize=8)
        ax.set_xlabel("key chunk")
        if step == 0:
            ax.set_ylabel("query chunk")
        sources = ", ".join(f"r{r}<-r{ring_source(r, step, cp)}" for r in range(cp))
        ax.set_title(f"step {step}: K/V held {sources}" if step else "step 0: own K/V", fontsize=9)
    handles = [Patch(facecolor=COLOURS["full"], label="full block (no mask)"),
               Patch(facecolor=COLOURS["causal"], label="diagonal, is_causal"),
               Patch(facecolor=COLOURS["skip"], hatch="//", label="skipped (no compute)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.suptitle(f"Ring attention, cp = {cp}: rank r holds chunks r and {2 * cp - 1}-r; K/V pass r -> r+1 each step",
                 fontsize=10)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".png"))
    options = parser.parse_args()
    draw(options.cp, options.out)
    print(options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
