"""Summarise a gradient log (``lowgrad.diagnostics.StepLog``'s JSON lines): a table of the
per-layer gradient norms, the noise scale over the steps and the non-finite steps; the same as
JSON, and with matplotlib (``pip install ".[plot]"``) three PNGs: per-layer norms over the steps
(a heatmap of log10 norm), the noise scale over the steps, non-finite values per step.

    python3 tools/grad_report.py --log run/grad.jsonl --out report/
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import PLOT_EXTRA, CannotRun, Parser, has_matplotlib, output_path
from _cli import run as run_tool

from lowgrad.diagnostics.log import read_log

NAME = "grad_report"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The report as a dict: steps, per-layer norm summaries and series, noise scale, events."""
    layers: dict[int, list[float | None]] = {}
    for i, r in enumerate(records):
        for entry in r["layers"]:
            layers.setdefault(entry["layer"], [None] * len(records))[i] = entry["norm"]
    summary = {}
    for layer, norms in sorted(layers.items()):
        finite = [x for x in norms if x is not None]
        summary[str(layer)] = {"min": min(finite, default=None),
                               "median": statistics.median(finite) if finite else None,
                               "max": max(finite, default=None), "last": norms[-1], "norms": norms}
    noise = [{"step": r["step"], "b_simple": (r["global"]["noise"] or {}).get("b_simple"),
              "ema": ((r["global"]["noise"] or {}).get("ema") or {}).get("b_simple"),
              "b_simple_local": (r["global"]["noise_local"] or {}).get("b_simple")} for r in records]
    return {"steps": [r["step"] for r in records], "world": records[-1]["world"],
            "micro_steps": records[-1]["micro_steps"], "skipped": sum(bool(r["skipped"]) for r in records),
            "layers": summary, "noise": noise,
            "nonfinite": [{"step": r["step"], "values": r["global"]["nonfinite"], "message": r["nonfinite"]["message"]}
                          for r in records if r["nonfinite"]]}


def table(report: dict[str, Any], log: str, rows: int) -> str:
    """The printed table; the noise scale of at most ``rows`` steps, evenly spaced, the first and
    last included (one row: the last)."""
    steps = report["steps"]
    out = [f"{len(steps)} steps ({steps[0]}..{steps[-1]}) from {log}: world {report['world']}, "
           f"{report['micro_steps']} micro-steps, {report['skipped']} skipped", "",
           "gradient norm per layer (-1: the non-block tensors)",
           f"{'layer':>6} {'min':>10} {'median':>10} {'max':>10} {'last':>10}"]
    for layer, s in report["layers"].items():
        out.append(f"{layer:>6} {_f(s['min']):>10} {_f(s['median']):>10} {_f(s['max']):>10} {_f(s['last']):>10}")
    noise = report["noise"]
    last = len(noise) - 1
    shown = [noise[i] for i in sorted({round(k * last / (rows - 1)) for k in range(rows)})] if rows > 1 else [noise[-1]]
    out += ["", "noise scale B_simple (samples): this step, its moving average, from the local gradients",
            f"{'step':>8} {'b_simple':>10} {'ema':>10} {'local':>10}"]
    out += [f"{n['step']:>8} {_f(n['b_simple']):>10} {_f(n['ema']):>10} {_f(n['b_simple_local']):>10}" for n in shown]
    out += ["", f"non-finite steps: {len(report['nonfinite'])}"]
    out += [f"  {e['message']}" for e in report["nonfinite"]]
    return "\n".join(out)


def plot(report: dict[str, Any], folder: str) -> list[str]:
    """The three PNGs in ``folder``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps, layers = report["steps"], report["layers"]
    paths = [os.path.join(folder, f) for f in ("layer_norms.png", "noise_scale.png", "nonfinite.png")]

    fig, ax = plt.subplots(figsize=(10, 1 + 0.25 * len(layers)))
    norms = np.array([[np.nan if x is None or x <= 0 else math.log10(x) for x in s["norms"]] for s in layers.values()])
    im = ax.imshow(np.ma.masked_invalid(norms), aspect="auto", interpolation="nearest",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
    ax.set_yticks(range(len(layers)), list(layers))
    ax.set(xlabel="step", ylabel="layer", title="log10 gradient norm per layer")
    fig.colorbar(im, ax=ax)
    _save(fig, paths[0])

    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (("b_simple", "this step"), ("ema", "moving average"), ("b_simple_local", "local gradients")):
        pts = [(n["step"], n[key]) for n in report["noise"] if n[key] is not None and n[key] > 0]
        if pts:
            ax.plot(*zip(*pts), ".-" if key == "ema" else ".", label=label)
    ax.set(xlabel="step", ylabel="B_simple (samples)", yscale="log", title="gradient noise scale")
    ax.legend()
    _save(fig, paths[1])

    fig, ax = plt.subplots(figsize=(8, 3))
    events = report["nonfinite"]
    ax.bar([e["step"] for e in events], [e["values"] for e in events], color="tab:red")
    ax.set(xlim=(steps[0] - 0.5, steps[-1] + 0.5), xlabel="step", ylabel="non-finite values",
           title=f"non-finite steps: {len(events)}")
    _save(fig, paths[2])
    return paths


def _save(fig: Any, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = Parser(NAME, description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True, help="the gradient log (JSON lines of lowgrad.diagnostics.StepLog)")
    p.add_argument("--out", help=f"the folder to write {NAME}.json and the PNGs to (default: $OUT when set, "
                                 f"else ./{NAME})")
    p.add_argument("--rows", type=int, default=20, help="show the noise scale of at most this many steps")
    a = p.parse_args(argv)
    if a.rows < 1:
        p.error("--rows must be at least 1")
    said = logging.StreamHandler(sys.stderr)  # read_log's warnings (a line cut by a crash, left out)
    said.setFormatter(logging.Formatter(f"{NAME}: %(message)s"))
    said.setLevel(logging.WARNING)
    logger = logging.getLogger("lowgrad")
    logger.addHandler(said)  # for the read only: a second main() in one process says each warning once
    try:
        records = read_log(a.log)  # every field checked: a malformed one is a ValueError naming the line and field
    except (OSError, ValueError) as exc:
        raise CannotRun(f"--log {a.log}: {exc}") from None
    finally:
        logger.removeHandler(said)
    if not records:
        raise CannotRun(f"--log {a.log}: no steps in it")
    report = summarize(records)  # read_log checked every field of every record
    folder = a.out or os.environ.get("OUT") or output_path(NAME)
    os.makedirs(folder, exist_ok=True)
    print(table(report, a.log, a.rows))
    with open(os.path.join(folder, f"{NAME}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {os.path.join(folder, NAME + '.json')}")
    if not has_matplotlib():
        print(f"{NAME}: no PNGs: plots need matplotlib: {PLOT_EXTRA}", file=sys.stderr)
        return 0
    for path in plot(report, folder):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(NAME, main))
