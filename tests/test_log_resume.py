"""The diagnostics' running state across a resume: a run checkpointed with its StepLog's state
(the noise scales' moving averages, the step it expects next), stopped ("crashed") some steps
later and resumed from the checkpoint on the same log file reads back as the uninterrupted run's
log, field by field; the file keeps the superseded copies, after which a resumed line marks where
the resumed run took over. The state's own checks, and the log lines' round trip."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import Engine, _run
from test_log import step

from lowgrad import checkpoint
from lowgrad.diagnostics import NoiseScaleEMA, StepLog, read_log
from lowgrad.diagnostics.noise_scale import NoiseScale

EVERY, STEPS = 3, 8  # a checkpoint every 3 steps; 8 steps in all


def _life(c: Any, log_path: Path, root: Path, stop: int, resume: bool = True, load_log: bool = True) -> None:
    """One life of a world-2 run with statistics: resume from the newest checkpoint that loads
    (if any), then steps up to ``stop``, each recorded, a checkpoint with the log's state every
    EVERY steps. Returning without closing anything is a crash (every line is flushed already)."""
    e = Engine(c, "scatter_reduce", False, stats=True)
    log = StepLog(log_path, rank=c.rank)
    last = checkpoint.latest(root, verify=True) if resume else None
    if last is not None:
        found = checkpoint.load(last, e.gm, e.arrays())
        e.apply(found.arrays)
        if load_log:
            log.load_state_dict(found.meta["log"])
    for s in range(e.gm.step, stop):
        e.step(s)
        log.record(e.gm.step_stats(), skipped=False)  # recorded before the save: its state has this step
        if (s + 1) % EVERY == 0:
            checkpoint.save(root / f"step-{s + 1:06d}", e.gm, e.arrays(), meta={"log": log.state_dict()})
    e.gm.close()


def _straight(tmp_path: Path) -> list[dict[str, Any]]:
    _run(2, lambda c: _life(c, tmp_path / "straight.jsonl", tmp_path / "ck-straight", STEPS))
    return read_log(tmp_path / "straight.jsonl")


def test_a_resumed_log_reads_as_the_uninterrupted_runs(tmp_path: Path) -> None:
    straight = _straight(tmp_path)
    assert [r["step"] for r in straight] == list(range(STEPS))
    assert sum(r["global"]["noise"]["ema"] is not None for r in straight) == STEPS  # the EMA is in every line
    path, root = tmp_path / "grad.jsonl", tmp_path / "ck"
    _run(2, lambda c: _life(c, path, root, 5))  # checkpoint after step 2 (step-000003), crash after step 4
    _run(2, lambda c: _life(c, path, root, STEPS))  # resumed at step 3: steps 3 and 4 again
    assert read_log(path) == straight  # every field of every record, the moving averages included
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [ln.get("step", ln.get("resumed")) for ln in lines] == [0, 1, 2, 3, 4, {"step": 3}, 3, 4, 5, 6, 7]
    assert lines[3] == straight[3] and lines[6] == straight[3]  # the superseded copy kept, equal here


def test_a_second_crash_and_an_older_checkpoint(tmp_path: Path) -> None:
    """Two resumes, the second from an older checkpoint than the first life's newest (the newest
    lost): every resumed line supersedes what came after its checkpoint, whichever life wrote it."""
    straight = _straight(tmp_path)
    path, root = tmp_path / "grad.jsonl", tmp_path / "ck"
    _run(2, lambda c: _life(c, path, root, 4))  # saved at 3, crashed after step 3
    _run(2, lambda c: _life(c, path, root, 7))  # resumed at 3, saved at 6, crashed after step 6
    shutil.rmtree(root / "step-000006")
    _run(2, lambda c: _life(c, path, root, STEPS))  # resumed at 3 again
    assert read_log(path) == straight
    marks = [json.loads(ln)["resumed"]["step"] for ln in path.read_text().splitlines() if "resumed" in ln]
    assert marks == [3, 3]


def test_without_the_logs_state_the_averages_differ(tmp_path: Path) -> None:
    """What the state is for: resumed without it (the old behaviour), the moving averages restart at
    the checkpoint and the records after it differ from the uninterrupted run's, and the copies of
    the steps after the checkpoint are not superseded."""
    straight = _straight(tmp_path)
    path, root = tmp_path / "grad.jsonl", tmp_path / "ck"
    _run(2, lambda c: _life(c, path, root, 5))
    _run(2, lambda c: _life(c, path, root, STEPS, load_log=False))
    got = read_log(path)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
    for again, want in zip(got[5:], straight[3:], strict=True):
        assert again["global"]["noise"]["ema"] != want["global"]["noise"]["ema"], want["step"]
    assert {k: v for k, v in got[5].items() if k not in ("global", "layers")} == \
        {k: v for k, v in straight[3].items() if k not in ("global", "layers")}


def test_the_ema_state_round_trips_through_json_bit_for_bit() -> None:
    ema = NoiseScaleEMA(0.8)
    for i in range(5):
        for key in (("noise", "global"), ("noise", 3), ("noise_local", -1), "plain", None, 2.5):
            ema.update(key, NoiseScale.of(0.1 * i + 1 / 3, 7.0 / (i + 1)))
    again = NoiseScaleEMA(0.8)
    again.load_state_dict(json.loads(json.dumps(ema.state_dict())))
    for key in (("noise", "global"), ("noise", 3), ("noise_local", -1), "plain", None, 2.5):
        new = NoiseScale.of(1.5, 2.5)
        assert again.update(key, new) == ema.update(key, new)
    assert again.state_dict() == ema.state_dict()
    with pytest.raises(TypeError, match="a NoiseScaleEMA key of type frozenset cannot be saved"):
        ema.update(frozenset({1}), NoiseScale.of(1.0, 1.0))
        ema.state_dict()


@pytest.mark.parametrize(("state", "error", "match"), [
    ([], ValueError, "holds exactly 'decay' and 'sums'"),
    ({"decay": 0.9, "sums": []}, ValueError, "kept with decay 0.9, this one's is 0.8"),
    ({"decay": 0.8, "sums": {}}, TypeError, "sums are a list"),
    ({"decay": 0.8, "sums": [["k", 1.0, 2.0]]}, ValueError, r"sums\[0\] must be \[key, g2, trace, weight\]"),
    ({"decay": 0.8, "sums": [["k", 1.0, "2", 0.5]]}, TypeError, r"sums\[0\]: g2, trace and weight must be numbers"),
    ({"decay": 0.8, "sums": [["k", 1.0, True, 0.5]]}, TypeError, "must be numbers"),
    ({"decay": 0.8, "sums": [["k", 1.0, 2.0, 0.0]]}, ValueError, r"a weight is in \(0, 1\], got 0.0"),
    ({"decay": 0.8, "sums": [["k", 1.0, 2.0, float("nan")]]}, ValueError, "a weight is in"),
    ({"decay": 0.8, "sums": [[{"a": 1}, 1.0, 2.0, 0.5]]}, TypeError, r"sums\[0\]: a key is a str"),
    ({"decay": 0.8, "sums": [[["a", 1], 1.0, 2.0, 0.5], [["a", 1], 1.0, 2.0, 0.5]]}, ValueError,
     r"sums\[1\]: the key \('a', 1\) twice"),
])
def test_a_bad_ema_state_changes_nothing(state: Any, error: type[Exception], match: str) -> None:
    ema = NoiseScaleEMA(0.8)
    ema.update("k", NoiseScale.of(1.0, 2.0))
    before = ema.state_dict()
    with pytest.raises(error, match=match):
        ema.load_state_dict(state)
    assert ema.state_dict() == before


def test_a_bad_log_state_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "grad.jsonl"
    log = StepLog(path, rank=0)
    log.record(step(0), skipped=False)
    before = log.state_dict()
    assert before["step"] == 1
    for state, match in [({"ema": before["ema"]}, "holds exactly 'ema' and 'step'"),
                         ({**before, "step": -1}, "step is an int >= 0 or None"),
                         ({**before, "step": True}, "step is an int >= 0 or None"),
                         ({**before, "ema": {**before["ema"], "decay": 0.5}}, "kept with decay 0.5")]:
        with pytest.raises(ValueError, match=match):
            log.load_state_dict(state)
        assert log.state_dict() == before
    log.record(step(1), skipped=False)
    log.close()
    assert "resumed" not in path.read_text()  # no state was loaded: no resumed line


def test_a_resume_at_another_step_than_the_states_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A state saved before its step's record (or another checkpoint's): the resumed run's first
    step is not the one the state expects, and the WARNING says the averages are not the
    uninterrupted run's; the resumed line still supersedes what follows the step it resumes at."""
    path = tmp_path / "grad.jsonl"
    log = StepLog(path, rank=0)
    log.record(step(0), skipped=False)
    state = log.state_dict()  # expects step 1
    log.record(step(1), skipped=False)
    log.record(step(2), skipped=False)
    again = StepLog(path, rank=0)
    again.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        again.record(step(2), skipped=False)
    again.close()
    assert ["resumed at step 2, but its state was saved after step 0" in r.getMessage() for r in caplog.records] \
        == [True]
    assert [r["step"] for r in read_log(path)] == [0, 1, 2]
    other = StepLog(tmp_path / "other.jsonl", rank=1)  # only rank 0 says it
    other.load_state_dict(state)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        other.record(step(5, rank=1), skipped=False)
    assert not caplog.records and not (tmp_path / "other.jsonl").exists()


def test_a_resumed_line_cut_by_a_crash_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "grad.jsonl"
    log = StepLog(path, rank=0)
    for n in range(3):
        log.record(step(n), skipped=False)
    log.close()
    with open(path, "a") as fh:
        fh.write('{"format": 1, "resumed": {"st')  # killed in the middle of the resumed line
    assert [r["step"] for r in read_log(path)] == [0, 1, 2]
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        again = StepLog(path, rank=0)  # the next life ends the cut line, and its resumed line counts
        again.load_state_dict({"ema": NoiseScaleEMA().state_dict(), "step": None})
        again.record(step(1), skipped=False)
        again.close()
        assert [r["step"] for r in read_log(path)] == [0, 1]
    assert any("a line cut short by a crash" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("line", "match"), [
    ('{"format": 1, "resumed": {"step": -1}}', "resumed.step must be an integer >= 0"),
    ('{"format": 1, "resumed": {"step": 2, "x": 1}}', "resumed must hold only step"),
    ('{"format": 1, "resumed": 2}', "resumed must be a JSON object"),
    ('{"format": 2, "resumed": {"step": 2}}', "a resumed line is exactly"),
    ('{"format": 1, "resumed": {"step": 2}, "step": 1}', "a resumed line is exactly"),
])
def test_a_malformed_resumed_line_is_refused_naming_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "grad.jsonl"
    log = StepLog(path, rank=0)
    log.record(step(0), skipped=False)
    log.close()
    with open(path, "a") as fh:
        fh.write(line + "\n")
    with pytest.raises(ValueError, match=f"grad.jsonl:2: {match}"):
        read_log(path)
