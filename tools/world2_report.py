"""The world-2 evidence of ``tools/gpu_session.sh --world 2`` in one table: what it wrote under
``RUN`` (its ``run/`` folder) read back, nothing measured here.

- world 1: lowgrad's host us per call in both modes (issue 33: the blocking mode within 10%);
- NCCL: per collective and size, lowgrad's ms in the blocking and the non-blocking mode (host
  us per call beside), torch.distributed's, and torch ms / lowgrad ms (>= 0.95 is issue 33's bar);
- the 0.5B step at world 1 and 2 (torchrun): median step ms, the world-2 / world-1 ratio, PyTorch's
  peak MiB, the final loss, for lowgrad scatter_reduce, all_to_all and unsharded, DDP and FSDP2;
- the per-phase timeline of one world-2 step (medians over the timed steps: host ms, GPU ms, the
  GPU's lag behind the host at each phase's end) of lowgrad scatter_reduce beside DDP's.

A piece that did not run (a budget skip, a failure) is named, not guessed. Writes
``RUN/world2_report.json`` and prints the tables.

    python3 tools/world2_report.py RUN
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import CannotRun, Parser, run

STEP_RUNS = ("lowgrad_scatter_reduce", "lowgrad_all_to_all", "lowgrad_unsharded", "ddp", "fsdp2")
TIMELINE = ("lowgrad_scatter_reduce", "ddp")


def load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def nccl_table(run_dir: str) -> tuple[list[str], list[dict[str, Any]]]:
    modes = {m: load(os.path.join(run_dir, f"nccl_{m}.json")) for m in ("blocking", "nonblocking")}
    lines: list[str] = []
    rows: list[dict[str, Any]] = []
    for m, got in modes.items():
        if got is None:
            lines.append(f"nccl_bench {m}: no result (see run/nccl_{m}.log)")
    base = next((g for g in modes.values() if g is not None), None)
    if base is None:
        return lines, rows
    other = {m: {(r["op"], r["dtype"], r["bytes"]): r for r in g["rows"]} for m, g in modes.items() if g}
    torch_rows = {k: r for g in other.values() for k, r in g.items() if "torch_ms" in r}
    lines.append(f"{'op':<15}{'bytes':>12}{'blocking ms':>13}{'host us':>9}{'nonblk ms':>11}{'host us':>9}"
                 f"{'torch ms':>10}{'ratio b':>9}{'ratio nb':>9}")
    for key in sorted({k for g in other.values() for k in g}, key=lambda k: (k[0], k[1], k[2])):
        b, nb, t = other.get("blocking", {}).get(key), other.get("nonblocking", {}).get(key), torch_rows.get(key)
        row = {"op": key[0], "dtype": key[1], "bytes": key[2],
               "blocking_ms": b and b["lowgrad_ms"], "blocking_host_us": b and b["lowgrad_host_us"],
               "nonblocking_ms": nb and nb["lowgrad_ms"], "nonblocking_host_us": nb and nb["lowgrad_host_us"],
               "torch_ms": t and t["torch_ms"]}
        for m in ("blocking", "nonblocking"):
            row[f"ratio_{m}"] = row["torch_ms"] / row[f"{m}_ms"] if row["torch_ms"] and row[f"{m}_ms"] else None
        rows.append(row)
        lines.append(f"{key[0]:<15}{key[2]:>12}{_f(row['blocking_ms'], 13, 3)}{_f(row['blocking_host_us'], 9, 1)}"
                     f"{_f(row['nonblocking_ms'], 11, 3)}{_f(row['nonblocking_host_us'], 9, 1)}"
                     f"{_f(row['torch_ms'], 10, 3)}{_f(row['ratio_blocking'], 9, 2)}"
                     f"{_f(row['ratio_nonblocking'], 9, 2)}")
    return lines, rows


def world1_host(run_dir: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Host us per call at world 1, blocking / non-blocking (issue 33's bound: within 10%)."""
    got = {m: load(os.path.join(run_dir, f"nccl_w1_{m}.json")) for m in ("blocking", "nonblocking")}
    if not all(got.values()):
        return ["world 1: no result of both modes (see run/nccl_w1_*.log)"], []
    nb = {(r["op"], r["bytes"]): r for r in got["nonblocking"]["rows"]}  # type: ignore[index]
    lines, rows = [f"{'op':<15}{'bytes':>12}{'blocking us':>13}{'nonblk us':>11}{'ratio':>7}"], []
    for r in got["blocking"]["rows"]:  # type: ignore[index]
        o = nb.get((r["op"], r["bytes"]))
        if o is None:
            continue
        ratio = r["lowgrad_host_us"] / o["lowgrad_host_us"]
        rows.append({"op": r["op"], "bytes": r["bytes"], "blocking_host_us": r["lowgrad_host_us"],
                     "nonblocking_host_us": o["lowgrad_host_us"], "ratio": ratio})
        lines.append(f"{r['op']:<15}{r['bytes']:>12}{r['lowgrad_host_us']:>13.1f}{o['lowgrad_host_us']:>11.1f}"
                     f"{ratio:>7.3f}")
    return lines, rows


def step_table(run_dir: str) -> tuple[list[str], dict[str, Any]]:
    out: dict[str, Any] = {}
    lines = [f"{'run':<24}{'w1 ms':>9}{'w2 ms':>9}{'w2/w1':>7}{'w1 peak MiB':>13}{'w2 peak MiB':>13}"
             f"{'w1 loss':>9}{'w2 loss':>9}"]
    for name in STEP_RUNS:
        got = {w: load(os.path.join(run_dir, f"step_{name}_w{w}.json")) for w in (1, 2)}
        cell: dict[str, Any] = {}
        for w, r in got.items():
            if r is not None:
                cell[f"w{w}"] = {"step_ms": r["step_ms_median"], "peak_mib": r["torch_peak_mib"],
                                 "final_loss": r["loss"][-1], "losses": r["loss"], "label": r["label"]}
        out[name] = cell
        w1, w2 = cell.get("w1", {}), cell.get("w2", {})
        ratio = w2["step_ms"] / w1["step_ms"] if w1 and w2 else None
        lines.append(f"{name:<24}{_f(w1.get('step_ms'), 9, 1)}{_f(w2.get('step_ms'), 9, 1)}{_f(ratio, 7, 3)}"
                     f"{_f(w1.get('peak_mib'), 13, 0)}{_f(w2.get('peak_mib'), 13, 0)}"
                     f"{_f(w1.get('final_loss'), 9, 4)}{_f(w2.get('final_loss'), 9, 4)}")
    return lines, out


def timeline(run_dir: str) -> tuple[list[str], dict[str, Any]]:
    got = {n: load(os.path.join(run_dir, f"step_{n}_w2.json")) for n in TIMELINE}
    phases = {n: (r or {}).get("phases", {}) for n, r in got.items()}
    lines = []
    names = next((list(p["host_ms"]) for p in phases.values() if "host_ms" in p), [])
    if not names:
        return ["timeline: no world-2 step of " + " or ".join(TIMELINE)], phases
    head = f"{'phase':<12}" + "".join(f"{n[:12] + ' ' + k:>22}" for n in TIMELINE for k in ("host", "gpu", "lag"))
    lines.append(head)
    for ph in names:
        line = f"{ph:<12}"
        for n in TIMELINE:
            for key in ("host_ms", "gpu_ms", "lag_ms"):
                line += _f(phases[n].get(key, {}).get(ph), 22, 1)
        lines.append(line)
    return lines, phases


def _f(v: Any, width: int, digits: int) -> str:
    return f"{'—':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = Parser("world2_report", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", help="the run/ folder gpu_session.sh --world 2 wrote")
    args = ap.parse_args(argv)
    if not args.run or not os.path.isdir(args.run):
        raise CannotRun(f"needs the run/ folder of tools/gpu_session.sh --world 2 (got {args.run or 'none'})")
    nl, nrows = nccl_table(args.run)
    wl, w1rows = world1_host(args.run)
    sl, steps = step_table(args.run)
    tl, phases = timeline(args.run)
    print("NCCL at world 2 (ratio = torch ms / lowgrad ms)")
    print("\n".join(nl))
    print("\nworld 1: host us per call, blocking / non-blocking (issue 33: ratio <= 1.10)")
    print("\n".join(wl))
    print("\nthe 0.5B step under torchrun (median step ms; PyTorch's peak; rank 0's final loss)")
    print("\n".join(sl))
    print("\none world-2 step, per phase (ms; medians over the timed steps)")
    print("\n".join(tl))
    path = os.path.join(args.run, "world2_report.json")
    with open(path, "w") as f:
        json.dump({"nccl": nrows, "world1_host": w1rows, "steps": steps, "timeline": phases}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run("world2_report", main))
