#!/usr/bin/env python
"""Plot the loss curves of ``train_lm.py`` / ``train_transformer.py --json`` files: ``python
examples/plot_losses.py a.json b.json --out losses.png [--smooth 10]`` (needs matplotlib)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lm import plot_curves  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="--json files of train_lm.py")
    p.add_argument("--out", default="losses.png")
    p.add_argument("--smooth", type=int, default=1, help="plot the moving mean over this many steps")
    a = p.parse_args(argv)
    if a.smooth < 1:
        p.error("--smooth must be at least 1")
    runs = [json.loads(Path(f).read_text(encoding="utf-8")) for f in a.runs]
    for f, r in zip(a.runs, runs):
        held_out = f"  held-out {r['val_end']:.3f}" if "val_end" in r else ""
        print(f"{r['label']:<50} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}{held_out}  ({f})")
    if a.smooth > 1:
        w = a.smooth
        runs = [{**r, "label": f"{r['label']} ({w}-step mean)",
                 "loss": [sum(r["loss"][i - w + 1:i + 1]) / w for i in range(w - 1, len(r["loss"]))]} for r in runs]
    if not plot_curves(runs, a.out):
        return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
