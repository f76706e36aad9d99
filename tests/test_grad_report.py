"""tools/grad_report.py on a synthetic gradient log: the table, the JSON, the PNGs where matplotlib
is installed (the README's test command does not install it: there the PNG test skips) and the
line that names the plot extra where it is not, and one line for a log it cannot read."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lowgrad.diagnostics.log import StepLog
from lowgrad.diagnostics.report import Stats, StepStats

REPO = Path(__file__).resolve().parents[1]
TOOL = str(REPO / "tools" / "grad_report.py")
W, M, B, D = 2, 4, 8, 64
NAMES, LAYERS = ["embed", "layers.0.w", "layers.1.w"], [-1, 0, 1]


def _stats(x: np.ndarray) -> Stats:
    """Stats of the three tensors (D values each) of gradients ``x`` [..., 3 D]."""
    t = x.reshape(*x.shape[:-1], 3, D)
    bad = ~np.isfinite(t)
    return Stats((t ** 2).sum(-1), bad.sum(-1), np.where(bad, 0, np.abs(t)).max(-1))


def write_log(path: Path, steps: int = 40, bad_step: int = 23) -> None:
    rng = np.random.default_rng(0)
    g = rng.normal(size=3 * D) * 0.05
    with StepLog(path, rank=0) as log:
        for n in range(steps):
            local = (g + rng.normal(size=(W, M, 3 * D)) / np.sqrt(B)) / M
            if n == bad_step:
                local[1, 2, D + 5] = np.nan
            micro = local.mean(axis=0)
            parts = np.zeros((W, 3 * D))
            parts[0, : 3 * D // 2] = micro.sum(0)[: 3 * D // 2]
            parts[1, 3 * D // 2:] = micro.sum(0)[3 * D // 2:]
            mparts = np.zeros((W, M, 3 * D))
            mparts[0, :, : 3 * D // 2] = micro[:, : 3 * D // 2]
            mparts[1, :, 3 * D // 2:] = micro[:, 3 * D // 2:]
            st = StepStats(names=NAMES, layers=LAYERS, accumulated=_stats(parts), micro=_stats(mparts),
                           local=_stats(local), micro_batch=B * W, local_batch=B, step_batch=B * W * M, step=100 + n,
                           rank=0, world=W, micro_steps=M)
            log.record(st, skipped=n == bad_step)


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "OUT"}
    e.update(env)
    return subprocess.run([sys.executable, TOOL, *args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=120, check=False)


def test_table_and_json(tmp_path: Path) -> None:
    write_log(tmp_path / "grad.jsonl")
    fake = tmp_path / "fake" / "matplotlib"  # as on an install without the plot extra
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (stand-in)')\n")
    proc = run(["--log", "grad.jsonl", "--rows", "5"], tmp_path, PYTHONPATH=str(fake.parent))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("40 steps (100..139) from grad.jsonl: world 2, 4 micro-steps, 1 skipped")
    assert "non-finite steps: 1\n  step 123 skipped: layers.0.w non-finite at micro-step 2 on rank 1, 1 value" in out
    noise_rows = out.split("from the local gradients\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [int(r.split()[0]) for r in noise_rows] == [100, 110, 120, 129, 139]
    layer_rows = out.split("(-1: the non-block tensors)\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [r.split()[0] for r in layer_rows] == ["-1", "0", "1"]
    report = json.loads((tmp_path / "grad_report" / "grad_report.json").read_text())
    assert report["steps"] == list(range(100, 140)) and report["layers"]["0"]["norms"][23] is None
    assert report["nonfinite"][0]["step"] == 123 and report["nonfinite"][0]["values"] == 1
    ema = [n["ema"] for n in report["noise"] if n["ema"] is not None]
    assert len(ema) == 39 and all(e > 0 for e in ema)
    assert proc.stderr == ('grad_report: no PNGs: plots need matplotlib: pip install ".[plot]" '
                           '(or pip install matplotlib)\n')
    assert not list((tmp_path / "grad_report").glob("*.png"))


def test_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "grad.jsonl")
    out = tmp_path / "out"
    proc = run(["--log", str(tmp_path / "grad.jsonl")], tmp_path, OUT=str(out))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    for name in ("grad_report.json", "layer_norms.png", "noise_scale.png", "nonfinite.png"):
        assert (out / name).read_bytes()[:8] == (b"\x89PNG\r\n\x1a\n" if name.endswith(".png") else b"{\n \"step")
        assert f"wrote {out / name}" in proc.stdout


def _malformed(path: Path, change: str) -> str:
    """A well-formed log of 5 steps, then line 3 changed by ``change`` (Python run on ``r``)."""
    write_log(path, steps=5, bad_step=1)
    lines = path.read_text().splitlines()
    r = json.loads(lines[2])
    exec(change, {"r": r})
    lines[2] = json.dumps(r)  # a NaN goes out as the token NaN, which json reads back
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,why", [
    (None, "No such file"), ("", "no steps in it"), ("x\n", ":1: not JSON"),
    ('{"format": 1, "step": 3}\n', ":1: rank is missing"),
    ("r['global']['noise']['b_simple'] = 'big'",
     ":3: global.noise.b_simple must be a finite number or null, got 'big'"),
    ("r['global']['noise']['b_simple'] = float('nan')", ":3: global.noise.b_simple must be a finite number or null"),
    ("r['global']['norm'] = float('inf')", ":3: global.norm must be a finite number >= 0 or null, got inf"),
    ("del r['layers'][0]['norm']", ":3: layers[0].norm is missing"),
    ("r['layers'][1]['layer'] = '0'", ":3: layers[1].layer must be an integer >= -1, got '0'"),
    ("r['layers'] = None", ":3: layers must be a list, got None"),
    ("r['global']['noise'] = []", ":3: global.noise must be a JSON object, got []"),
    ("r['skipped'] = 'no'", ":3: skipped must be true or false"),
    ("r['world'] = 2.0", ":3: world must be an integer >= 1, got 2.0"),
    ("r['nonfinite'] = {'message': 'x'}", ":3: nonfinite.step is missing"),
    ("del r['micro_steps']", ":3: micro_steps is missing"),
    ("r['step'] = None", ":3: step must be an integer >= 0, got None")])
def test_a_log_it_cannot_read_is_one_line(tmp_path: Path, text: str | None, why: str) -> None:
    """Any malformed field, not only a malformed line, is one line naming it and exit 2."""
    if text is not None and text.startswith(("r[", "del ")):
        text = _malformed(tmp_path / "grad.jsonl", text)
    if text is not None:
        (tmp_path / "grad.jsonl").write_text(text)
    proc = run(["--log", "grad.jsonl"], tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("grad_report: --log grad.jsonl: ")
    assert why in lines[0] and not (tmp_path / "grad_report").exists()


def test_a_log_cut_by_a_crash_and_resumed_reads_with_the_cut_line_named(tmp_path: Path) -> None:
    """Killed in the middle of step 104's line, resumed at step 104: every step is reported; the
    cut line is named on stderr."""
    path = tmp_path / "grad.jsonl"
    write_log(path, steps=5)
    text = path.read_bytes()
    start = text.rstrip(b"\n").rfind(b"\n") + 1
    os.truncate(path, start + (len(text) - start) // 2)
    write_log(path, steps=8)  # the resumed run (its StepLog appends), from step 100 again
    proc = run(["--log", str(path)], tmp_path, OUT=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert f"grad_report: gradient log {path}:5: a line cut short by a crash" in proc.stderr
    assert proc.stdout.startswith(f"12 steps (100..107) from {path}")


def test_main_called_twice_says_the_warning_once_per_call_and_leaves_no_handler(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main() in one process (a notebook, a test): its warning handler lives for the read only, so
    a second call prints the cut line once, not twice, and the 'lowgrad' logger is left as found."""
    import logging

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import grad_report
    finally:
        sys.path.remove(str(REPO / "tools"))
    path = tmp_path / "grad.jsonl"
    write_log(path, steps=3)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"format": 1, "step": 3, "x\n')  # a line cut by a crash: read_log warns
    logger = logging.getLogger("lowgrad")
    before = list(logger.handlers)
    cut = f"grad_report: gradient log {path}:4: a line cut short by a crash"
    for _ in range(2):
        assert grad_report.main(["--log", str(path), "--out", str(tmp_path / "out")]) == 0
        assert capsys.readouterr().err.count(cut) == 1
        assert logger.handlers == before
    (tmp_path / "bad.jsonl").write_text("not json\n")  # the read fails: the handler goes too
    with pytest.raises(grad_report.CannotRun, match="not JSON"):
        grad_report.main(["--log", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out")])
    assert logger.handlers == before
