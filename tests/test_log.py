"""The gradient log: what a line holds, the round trip through read_log, rank 0 alone writing,
the non-finite line on the ``lowgrad`` logger, and a full disk that does not stop training."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from lowgrad.diagnostics.log import StepLog, read_log
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


@pytest.mark.parametrize("text,match", [('{"format": 1}\nnot json\n{"format": 1}\n', ":2: not JSON"),
                                        ('{"format": 2}\n', ":1: not a gradient log line of format 1"),
                                        ('[1]\n', ":1: not a gradient log line")])
def test_bad_lines(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "grad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_log(path)


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
