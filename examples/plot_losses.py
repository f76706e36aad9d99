#!/usr/bin/env python
"""Plot the loss curves of ``train_lm.py`` / ``train_transformer.py --json`` files: ``python
examples/plot_losses.py a.json b.json [--out losses.png] [--smooth 10]`` (needs matplotlib:
``pip install ".[plot]"``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from _cli import CannotRun, Parser, int_at_least, output_path, require_matplotlib, run


def plot_curves(runs: list[dict[str, Any]], out: str) -> None:
    """Loss against step for every run (dicts with ``label`` and ``loss``) into PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(range(len(r["loss"])), r["loss"], label=r["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per symbol)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the plot was written; 2 (one line on stderr, nothing written) without
    matplotlib, or for a file that is not such a JSON or an output folder that does not exist."""
    p = Parser("plot_losses", description=__doc__)
    p.add_argument("runs", nargs="+", help="--json files of train_lm.py or train_transformer.py")
    p.add_argument("--out", help="the PNG to write (default: $OUT/losses.png when OUT is set, else ./losses.png; "
                   "never the repository's root)")
    p.add_argument("--smooth", type=int_at_least(1), default=1, help="plot the moving mean over this many steps")
    a = p.parse_args(argv)
    require_matplotlib()
    out = output_path("losses.png", a.out)
    runs = []
    for f in a.runs:
        try:
            r = json.loads(Path(f).read_text(encoding="utf-8"))
            if not (isinstance(r["label"], str) and r["loss"] and all(isinstance(x, (int, float)) for x in r["loss"])):
                raise ValueError("no label or no loss curve")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CannotRun(f"{f}: not a --json file of train_lm.py or train_transformer.py "
                            f"({type(exc).__name__}: {exc})") from None
        runs.append(r)
    for f, r in zip(a.runs, runs):
        held_out = f"  held-out {r['val_end']:.3f}" if "val_end" in r else ""
        print(f"{r['label']:<50} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}{held_out}  ({f})")
    if a.smooth > 1:
        w = a.smooth
        runs = [{**r, "label": f"{r['label']} ({w}-step mean)",
                 "loss": [sum(r["loss"][i - w + 1:i + 1]) / w for i in range(w - 1, len(r["loss"]))]} for r in runs]
    plot_curves(runs, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run("plot_losses", main))
