#!/usr/bin/env python
"""Plot the loss curves of ``train_lm.py --json`` files: ``python examples/plot_losses.py
a.json b.json --out losses.png`` (needs matplotlib)."""
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
    a = p.parse_args(argv)
    runs = [json.loads(Path(f).read_text(encoding="utf-8")) for f in a.runs]
    for f, r in zip(a.runs, runs):
        print(f"{r['label']:<50} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}  held-out {r['val_end']:.3f}  ({f})")
    if not plot_curves(runs, a.out):
        return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
