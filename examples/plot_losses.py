#!/usr/bin/env python
"""Plot the loss curves of ``train_lm.py`` / ``train_transformer.py --json`` files: ``python
examples/plot_losses.py a.json b.json --out losses.png [--smooth 10]`` (needs matplotlib:
``pip install ".[plot]"``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lm import NEEDS_MATPLOTLIB, CannotRun, OneLineParser, cannot_run, plot_curves


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the plot was written; 2 (one line on stderr, nothing written) without
    matplotlib, or for a file that is not such a JSON or an output folder that does not exist."""
    p = OneLineParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="--json files of train_lm.py or train_transformer.py")
    p.add_argument("--out", default="losses.png", help="the PNG to write (default: ./losses.png)")
    p.add_argument("--smooth", type=int, default=1, help="plot the moving mean over this many steps")
    a = p.parse_args(argv)
    if a.smooth < 1:
        p.error("--smooth must be at least 1")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return _say(NEEDS_MATPLOTLIB)
    if not Path(a.out).resolve().parent.is_dir():
        return _say(f"--out {a.out}: no such directory")
    runs = []
    for f in a.runs:
        try:
            r = json.loads(Path(f).read_text(encoding="utf-8"))
            if not (isinstance(r["label"], str) and r["loss"] and all(isinstance(x, (int, float)) for x in r["loss"])):
                raise ValueError("no label or no loss curve")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return _say(f"{f}: not a --json file of train_lm.py or train_transformer.py ({type(exc).__name__}: {exc})")
        runs.append(r)
    for f, r in zip(a.runs, runs):
        held_out = f"  held-out {r['val_end']:.3f}" if "val_end" in r else ""
        print(f"{r['label']:<50} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}{held_out}  ({f})")
    if a.smooth > 1:
        w = a.smooth
        runs = [{**r, "label": f"{r['label']} ({w}-step mean)",
                 "loss": [sum(r["loss"][i - w + 1:i + 1]) / w for i in range(w - 1, len(r["loss"]))]} for r in runs]
    if not plot_curves(runs, a.out):
        return 2
    print(f"wrote {a.out}")
    return 0


def _say(why: str) -> int:
    return cannot_run("plot_losses.py", CannotRun(why))


if __name__ == "__main__":
    sys.exit(main())
