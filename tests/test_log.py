"""The gradient log: what a line holds, the round trip through read_log, rank 0 alone writing,
the non-finite line on the ``lowgrad`` logger, and a full disk that does not stop training."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lowgrad.diagnostics.log import StepLog, read_log, step_record
from lowgrad.diagnostics.noise_scale import NoiseScaleEMA
from lowgrad.diagnostics.report import Stats, StepStats

W, M, NAMES, LAYERS = 2, 4, ["embed", "layers.0.w", "layers.1.w"], [-1, 0, 1]


def step(n: int, rank: int = 0, bad: bool = False, seed: int = 0) -> StepStats:
    rng = np.random.default_rng(seed + n)
    T = len(NAMES)

    def stats(shape: tuple[int, ...]) -> Stats:
        return Stats(rng.uniform(0.5, 2.0, shape), np.zeros(shape, np.int64), rng.uniform(0.1, 1.0, shape))

    local, micro, acc = stats((W, M, T)), stats((W, M, T)), stats((W, T))
    acc = Stats(micro.sumsq.sum(axis=1) / M, acc.nonfinite, acc.maxabs)
    if bad:
        local.nonfinite[1, 2, 1] = 3
        local.sumsq[1, 2, 1] = micro.sumsq[:, 2, 1] = acc.sumsq[:, 1] = np.nan
        micro.nonfinite[:, 2, 1] = acc.nonfinite[:, 1] = 1
    return StepStats(names=NAMES, layers=LAYERS, accumulated=acc, micro=micro, local=local, micro_batch=8 * W,
                     local_batch=8, step_batch=8 * W * M, step=n, rank=rank, world=W, micro_steps=M)


def test_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "grad.jsonl"
    with caplog.at_level(logging.WARNING, logger="lowgrad"), StepLog(path, rank=0, per_tensor=True) as log:
        written = [log.record(step(n, bad=n == 2), skipped=n == 2) for n in range(4)]
    assert read_log(path) == written
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all("NaN" not in ln and "Infinity" not in ln for ln in lines)  # strict JSON
    r = written[1]
    assert (r["format"], r["step"], r["rank"], r["world"], r["micro_steps"], r["skipped"]) == (1, 1, 0, W, M, False)
    assert r["batch"] == {"micro": 16, "local": 8, "step": 64}
    assert [x["layer"] for x in r["layers"]] == LAYERS and [t["name"] for t in r["tensors"]] == NAMES
    s = step(1).summary()
    assert r["global"]["norm"] == s.norm and r["global"]["noise"]["b_simple"] == s.noise.b_simple
    assert r["global"]["noise"]["ema"]["g2"] == pytest.approx((0.1 * 0.9 * written[0]["global"]["noise"]["g2"]
                                                              + 0.1 * s.noise.g2) / (1 - 0.9 ** 2))
    assert r["global"]["noise_local"]["trace"] == s.noise_local.trace and r["nonfinite"] is None
    assert len(r["tensors"][0]["micro_norms"]) == M
    bad = written[2]
    assert bad["skipped"] and bad["global"]["norm"] is None and bad["global"]["noise"] is None
    assert bad["layers"][1]["noise"] is None and bad["layers"][2]["noise"] is not None
    assert bad["global"]["nonfinite"] == W and bad["tensors"][1]["micro_norms"][2] is None
    report = bad["nonfinite"]
    assert (report["parameter"], report["source"], report["micro_step"], report["rank"], report["count"]) == \
        ("layers.0.w", "local", 2, 1, 3)
    assert report["message"].startswith("step 2 skipped: layers.0.w non-finite at micro-step 2 on rank 1")
    assert [rec.getMessage() for rec in caplog.records] == [report["message"]]
    # the EMA skipped the non-finite step: step 3's average folds in steps 0, 1 and 3 only
    g = [w["global"]["noise"]["g2"] for w in written if w["global"]["noise"]]
    assert written[3]["global"]["noise"]["ema"]["g2"] == pytest.approx(
        0.1 * (0.81 * g[0] + 0.9 * g[1] + g[2]) / (1 - 0.9 ** 3))
    assert "tensors" not in StepLog(tmp_path / "short.jsonl", rank=0).record(step(0), skipped=False)


def test_only_rank_0_writes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "grad.jsonl"
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        log = StepLog(path, rank=1)
        rec = log.record(step(5, rank=1, bad=True), skipped=True)
        log.close()
    assert not path.exists() and rec["rank"] == 1 and rec["nonfinite"] is not None and not caplog.records
    with pytest.raises(ValueError, match="rank 0 given to the log of rank 1"):
        StepLog(path, rank=1).record(step(0), skipped=False)
    with pytest.raises(ValueError, match="rank"):
        StepLog(path, rank=-1)


def test_appends_and_reads_an_unfinished_last_line(tmp_path: Path) -> None:
    path = tmp_path / "grad.jsonl"
    for n in range(2):  # a resumed run appends
        with StepLog(path, rank=0) as log:
            log.record(step(n), skipped=False)
    with open(path, "a") as f:
        f.write('{"format": 1, "step": 2, "gl')  # killed in the middle of a write
    assert [r["step"] for r in read_log(path)] == [0, 1]


def line(n: int = 0, bad: bool = False) -> str:
    """One well-formed log line (per tensor, with a non-finite report when ``bad``)."""
    return json.dumps(step_record(step(n, bad=bad), skipped=bad, ema=NoiseScaleEMA(0.9), per_tensor=True))


@pytest.mark.parametrize("text,match", [("{0}\nnot json\n{0}\n", ":2: not JSON"),
                                        ("{0}\nnot json", ":2: not JSON"),  # not a cut record either
                                        ('{{"format": 2}}\n', ":1: not a gradient log line of format 1"),
                                        ('{{"format": true}}\n', ":1: not a gradient log line of format 1"),
                                        ('[1]\n', ":1: not a gradient log line")])
def test_bad_lines(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "grad.jsonl"
    path.write_text(text.format(line()))
    with pytest.raises(ValueError, match=match):
        read_log(path)


def _set(record: dict, path: str, value: object) -> None:
    *parents, last = path.split(".")
    for key in parents:
        record = record[int(key)] if isinstance(record, list) else record[key]
    if value is DELETE:
        del record[last]
    elif isinstance(record, list):
        record[int(last)] = value
    else:
        record[last] = value


DELETE = object()
NAN = float("nan")
MALFORMED = [("global.noise.b_simple", "x", "global.noise.b_simple must be a finite number or null, got 'x'"),
             ("global.noise.b_simple", NAN, "global.noise.b_simple must be a finite number or null, got nan"),
             ("global.noise.ema.g2", [1], r"global.noise.ema.g2 must be a finite number or null"),
             ("global.noise.ema", 3, "global.noise.ema must be a JSON object"),
             ("global.noise", DELETE, "global.noise is missing"),
             ("global.norm", -1.0, "global.norm must be a finite number >= 0 or null"),
             ("global.norm", float("inf"), "global.norm must be a finite number >= 0 or null"),
             ("global.nonfinite", 1.5, "global.nonfinite must be an integer >= 0"),
             ("global.maxabs", None, "global.maxabs must be a finite number >= 0, got None"),
             ("global", None, "global must be a JSON object"),
             ("step", "7", "step must be an integer >= 0"), ("step", True, "step must be an integer"),
             ("step", DELETE, "step is missing"), ("rank", 5, "rank must be below world 2"),
             ("world", 0, "world must be an integer >= 1"), ("micro_steps", None, "micro_steps must be"),
             ("batch.local", 0, "batch.local must be an integer >= 1"), ("batch", [], "batch must be a JSON object"),
             ("skipped", 1, "skipped must be true or false"), ("layers", {}, "layers must be a list"),
             ("layers.1.layer", -2, r"layers\[1\].layer must be an integer >= -1"),
             ("layers.0.noise_local", "big", r"layers\[0\].noise_local must be a JSON object"),
             ("layers.2", 7, r"layers\[2\] must be a JSON object"),
             ("tensors.0.name", "", r"tensors\[0\].name must be a non-empty string"),
             ("tensors.1.micro_norms.2", "x", r"tensors\[1\].micro_norms\[2\] must be a finite number"),
             ("tensors.1.micro_norms", 3, r"tensors\[1\].micro_norms must be a list"),
             ("tensors.2.maxabs", DELETE, r"tensors\[2\].maxabs is missing"),
             ("nonfinite", DELETE, "nonfinite is missing"), ("nonfinite", "x", "nonfinite must be a JSON object"),
             ("nonfinite.message", 5, "nonfinite.message must be a non-empty string"),
             ("nonfinite.source", "disk", "nonfinite.source must be local, micro or step"),
             ("nonfinite.micro_step", -1, "nonfinite.micro_step must be an integer >= 0"),
             ("nonfinite.count", 0, "nonfinite.count must be an integer >= 1"),
             ("nonfinite.world", DELETE, "nonfinite.world is missing")]


@pytest.mark.parametrize("field,value,match", MALFORMED)
def test_every_malformed_field_is_named(tmp_path: Path, field: str, value: object, match: str) -> None:
    """read_log checks each field of each record once, for every reader (tools/grad_report.py):
    a ValueError naming the line and the field, never a KeyError or TypeError later."""
    bad = field.startswith("nonfinite.")  # a step with a non-finite report (and so no global noise scale)
    record = json.loads(line(1, bad=bad))
    _set(record, field, value)
    path = tmp_path / "grad.jsonl"
    path.write_text(line(0) + "\n" + json.dumps(record) + "\n")  # NaN written as the token NaN
    with pytest.raises(ValueError, match=":2: " + match):
        read_log(path)
    path.write_text(line(0) + "\n" + line(1, bad=bad) + "\n")
    assert len(read_log(path)) == 2  # the same record well-formed reads


def cut_then_resume(path: Path, cut_at: int) -> None:
    """Steps 0-2 logged, the run killed ``cut_at`` bytes into step 2's line, resumed from step 2."""
    with StepLog(path, rank=0) as log:
        for n in range(3):
            log.record(step(n), skipped=False)
    text = path.read_bytes()
    start = text.rstrip(b"\n").rfind(b"\n") + 1  # where step 2's line begins
    os.truncate(path, start + cut_at)  # the file as a kill in the middle of that write leaves it


@pytest.mark.parametrize("cut_at", [1, 5, 20, 300])
def test_a_log_cut_by_a_crash_then_resumed_reads_completely(tmp_path: Path, cut_at: int,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The resumed log starts on a whole line: only the cut line is lost, and it is named."""
    path = tmp_path / "grad.jsonl"
    cut_then_resume(path, cut_at)
    cut = path.read_bytes().split(b"\n")[2]
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        assert [r["step"] for r in read_log(path)] == [0, 1]  # running or killed: the cut tail left out
        assert not caplog.records
        with StepLog(path, rank=0) as log:  # resumed: step 2 again, then 3
            for n in (2, 3):
                log.record(step(n), skipped=False)
        assert "its last line was cut" in caplog.records[-1].getMessage()
        caplog.clear()
        assert [r["step"] for r in read_log(path)] == [0, 1, 2, 3]
    assert path.read_bytes().split(b"\n")[2] == cut  # the evidence stays, on its own line
    (warning,) = caplog.records
    assert f"gradient log {path}:3: a line cut short by a crash ({cut_at} characters), left out" == warning.getMessage()
    with StepLog(path, rank=0):  # a log that ends on a whole line gets nothing written at open
        pass
    assert [r["step"] for r in read_log(path)] == [0, 1, 2, 3]


KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_log import step
from lowgrad.diagnostics.log import StepLog
log = StepLog({path!r}, rank=0)
for n in range(3):
    log.record(step(n), skipped=False)
real = log._file.write
def write(text):  # the kernel took part of step 3's line when the kill came
    real(text[:len(text) // 2])
    log._file.flush()
    os.kill(os.getpid(), signal.SIGKILL)
log._file.write = write
log.record(step(3), skipped=False)
"""


def test_a_writer_killed_by_sigkill_then_resumed(tmp_path: Path) -> None:
    path = tmp_path / "grad.jsonl"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER.format(tests=str(Path(__file__).parent),
                                                                     path=str(path))],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not path.read_bytes().endswith(b"\n")
    with StepLog(path, rank=0) as log:
        for n in (3, 4):
            log.record(step(n), skipped=False)
    assert [r["step"] for r in read_log(path)] == [0, 1, 2, 3, 4]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_full_disk_warns_once_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    log = StepLog("/dev/full", rank=0)
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        records = [log.record(step(n), skipped=False) for n in range(3)]
    assert [r["step"] for r in records] == [0, 1, 2]
    (warning,) = caplog.records
    assert "gradient log /dev/full: writing step 0 failed" in warning.getMessage()
    assert "No space left" in warning.getMessage()
    log.close()


def test_a_path_that_cannot_be_opened_raises_at_once(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        StepLog(tmp_path / "missing" / "grad.jsonl", rank=0)



@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_ending_a_cut_line_on_a_full_disk_warns_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The newline that ends a cut line is a write like any other: on a full disk it warns once,
    the log stops, and the resumed run goes on."""
    import lowgrad.diagnostics.log as log_module
    path = tmp_path / "grad.jsonl"
    cut_then_resume(path, 20)

    def full_disk(name: object, mode: str = "r", *args: object, **kw: object) -> object:
        return open("/dev/full" if "a" in mode else name, mode, *args, **kw)  # type: ignore[call-overload]
    monkeypatch.setattr(log_module, "open", full_disk, raising=False)
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        log = StepLog(path, rank=0)
        assert log.record(step(5), skipped=False)["step"] == 5
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"gradient log {path}"] * 2
    assert "writing the end of the cut line failed" in caplog.records[1].getMessage()
    assert "No space left" in caplog.records[1].getMessage()
    log.close()
