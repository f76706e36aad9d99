"""The gradient log: one JSON line per step (:class:`StepLog`), read back by :func:`read_log`.

Only rank 0 writes. Every rank holds every rank's statistics at the end of a step, so every rank
would write the same line: W copies of it, and W writers appending to one shared file interleave.
The one human line of a non-finite step goes to the ``lowgrad`` logger (WARNING) from rank 0 for
the same reason.

A failed write (a full disk, a lost network mount) does not raise into the training loop: the log
says so once on the ``lowgrad`` logger (WARNING, with the error and the step), stops writing and
the run goes on; diagnostics are not worth a crashed run, and a full disk is not the log's to
fix. A path that cannot be opened raises at construction, before training starts. Each line is
flushed as it is written, so a crashed run keeps its lines and a running one can be read. A run
killed in the middle of a write leaves a cut last line; the resumed run's log ends it with a
newline before it appends (a WARNING says so), and :func:`read_log` leaves that one line out, so
a crashed-and-resumed run's log reads completely, less the cut line.

A run resumed from a checkpoint repeats the steps its previous life ran after that checkpoint:
the log's running state (the noise scales' moving averages, the step it expects next) is saved
with the checkpoint (:meth:`StepLog.state_dict`) and restored with it
(:meth:`StepLog.load_state_dict`), and the resumed log writes one line before its first record,
``{"format": 1, "resumed": {"step": S}}`` (S: that record's step). The lines above it of step >= S
are the superseded copies; :func:`read_log` leaves them out, so the log reads as the
uninterrupted run's, field by field, and the file keeps them (the evidence of what happened
before the crash).

A line (``format`` 1; non-finite numbers are written as null: the line is strict JSON)::

    {"format": 1, "step": 812, "rank": 0, "world": 8, "micro_steps": 4,
     "batch": {"micro": 64, "local": 8, "step": 256}, "skipped": true,
     "global": SUMMARY, "layers": [{"layer": -1, ...SUMMARY}, {"layer": 0, ...}, ...],
     "tensors": [{"name": ..., "layer": ..., "norm": ..., "nonfinite": ..., "maxabs": ...,
                  "micro_norms": [...] or null}, ...],      (only with per_tensor=True)
     "nonfinite": {"message": "step 812 skipped: ...", "parameter": ..., ...} or null}

    SUMMARY = {"norm": ..., "nonfinite": ..., "maxabs": ..., "noise": NOISE, "noise_local": NOISE}
    NOISE = {"g2": ..., "trace": ..., "b_simple": ..., "ema": {"g2": ..., "trace": ..., "b_simple": ...}}
            or null (nothing to estimate from this step)

and the line of a resumed run (above): ``{"format": 1, "resumed": {"step": 812}}``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from types import TracebackType
from typing import IO, Any

from lowgrad.base.integers import integer
from lowgrad.base.trace import logger
from lowgrad.diagnostics.log_format import FORMAT, RESUMED, check_record, check_resumed
from lowgrad.diagnostics.noise_scale import NoiseScale, NoiseScaleEMA
from lowgrad.diagnostics.report import StepStats, Summary


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _noise(value: NoiseScale | None, averaged: NoiseScale | None) -> dict[str, Any] | None:
    if value is None:
        return None
    ema = None if averaged is None else {"g2": _num(averaged.g2), "trace": _num(averaged.trace),
                                         "b_simple": _num(averaged.b_simple)}
    return {"g2": _num(value.g2), "trace": _num(value.trace), "b_simple": _num(value.b_simple), "ema": ema}


def _summary(s: Summary, key: object, ema: NoiseScaleEMA) -> dict[str, Any]:
    return {"norm": _num(s.norm), "nonfinite": s.nonfinite, "maxabs": s.maxabs,
            "noise": _noise(s.noise, ema.update(("noise", key), s.noise)),
            "noise_local": _noise(s.noise_local, ema.update(("noise_local", key), s.noise_local))}


def step_record(stats: StepStats, *, skipped: bool, ema: NoiseScaleEMA, per_tensor: bool = False) -> dict[str, Any]:
    """The log line of one step as a dict (what :class:`StepLog` writes), folding its noise
    scales into ``ema``."""
    report = stats.first_nonfinite()
    record: dict[str, Any] = {
        "format": FORMAT, "step": stats.step, "rank": stats.rank, "world": stats.world,
        "micro_steps": stats.micro_steps,
        "batch": {"micro": stats.micro_batch, "local": stats.local_batch, "step": stats.step_batch},
        "skipped": bool(skipped),
        "global": _summary(stats.summary(), "global", ema),
        "layers": [{"layer": layer, **_summary(s, layer, ema)} for layer, s in stats.layer_summaries().items()],
    }
    if per_tensor:
        record["tensors"] = [{"name": t.name, "layer": t.layer, "norm": _num(t.norm), "nonfinite": t.nonfinite,
                              "maxabs": t.maxabs,
                              "micro_norms": None if t.micro_norms is None else [_num(x) for x in t.micro_norms]}
                             for t in stats.tensors().values()]
    record["nonfinite"] = None if report is None else {"message": str(report), **dataclasses.asdict(report)}
    return record


class StepLog:
    """The JSON-lines log of a run: create it on every rank with the rank's number; rank 0 opens
    ``path`` (appending: a resumed run continues its log) and writes, the others only keep the
    noise scales' moving averages (``ema_decay``, :class:`NoiseScaleEMA`) so that every rank's
    :meth:`record` returns the same line. ``per_tensor`` adds every parameter to each line.
    :meth:`state_dict` / :meth:`load_state_dict`: its running state, part of a checkpoint (the
    module's docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, rank: int, per_tensor: bool = False,
                 ema_decay: float = 0.9) -> None:
        self.rank = integer("rank", rank)
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        self.ema = NoiseScaleEMA(ema_decay)
        self.path, self.per_tensor = os.fspath(path), per_tensor
        self._file: IO[str] | None = None
        self._next: int | None = None  # the step after the last one recorded (None: none yet)
        self._resumed = False  # a state was loaded: the next record is a resumed run's first
        if self.rank == 0:
            self._file = open(self.path, "a", encoding="utf-8")
            self._end_cut_line()

    def _end_cut_line(self) -> None:
        """A log whose last line has no newline was cut by a crash in the middle of a write: end
        that line, so that this run's lines start on their own (the cut one stays in the file,
        the evidence; :func:`read_log` leaves it out and names it)."""
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, os.SEEK_END) == 0:  # empty (or a device such as /dev/full)
                    return
                f.seek(-1, os.SEEK_END)
                if f.read(1) == b"\n":
                    return
        except OSError:  # not readable by us (write-only): appended to as it is, as before
            return
        logger.warning("gradient log %s: its last line was cut by a crash in the middle of a write; it is ended "
                       "and left out when read, the run's lines go on after it", self.path)
        self._write("\n", "the end of the cut line")

    def record(self, stats: StepStats, *, skipped: bool) -> dict[str, Any]:
        """Log one step (``skipped``: whether the optimizer skipped it) and return its line as a
        dict; on rank 0, write it, and put the non-finite report on the ``lowgrad`` logger."""
        if stats.rank != self.rank:
            raise ValueError(f"statistics of rank {stats.rank} given to the log of rank {self.rank}")
        record = step_record(stats, skipped=skipped, ema=self.ema, per_tensor=self.per_tensor)
        head = ""
        if self._resumed:
            self._resumed = False
            head = json.dumps({"format": FORMAT, RESUMED: {"step": stats.step}}) + "\n"
            if self._next is not None and stats.step != self._next and self.rank == 0:
                logger.warning("gradient log %s: resumed at step %d, but its state was saved after step %d (saved "
                               "before the step's record, or another checkpoint's?): the moving averages are not "
                               "an uninterrupted run's", self.path, stats.step, self._next - 1)
        self._next = stats.step + 1
        if self.rank == 0:
            if record["nonfinite"] is not None:
                logger.warning("%s", record["nonfinite"]["message"])
            self._write(head + json.dumps(record, allow_nan=False) + "\n", f"step {stats.step}")
        return record

    def state_dict(self) -> dict[str, Any]:
        """The log's running state as JSON data, to save in a checkpoint taken after this step's
        :meth:`record` (``meta``): the moving averages (:meth:`NoiseScaleEMA.state_dict`) and the
        step it expects next."""
        return {"ema": self.ema.state_dict(), "step": self._next}

    def load_state_dict(self, state: Any) -> None:
        """Resume from a :meth:`state_dict` (a checkpoint's): the moving averages restored, and the
        next record preceded by the resumed line that supersedes the copies above it (the
        module's docstring). Checked whole first (:meth:`check_state`): ValueError or TypeError
        naming the entry, nothing changed. The next record's step should be the state's; another
        one is a WARNING on the ``lowgrad`` logger (the averages then differ from an
        uninterrupted run's)."""
        self.check_state(state)
        self.ema.load_state_dict(state["ema"])
        self._next, self._resumed = state["step"], True

    def check_state(self, state: Any) -> None:
        """What :meth:`load_state_dict` checks, changing nothing: for a caller that must know the
        state loads before it changes anything else (``lowgrad.torch.load_checkpoint``)."""
        if not isinstance(state, dict) or set(state) != {"ema", "step"}:
            raise ValueError(f"a StepLog state holds exactly 'ema' and 'step', got {state!r:.80}")
        step = state["step"]
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"a StepLog state's step is an int >= 0 or None, got {step!r:.60}")
        self.ema.check_state(state["ema"])

    def _write(self, line: str, what: str) -> None:
        if self._file is None:  # closed, or stopped by a failed write
            return
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            logger.warning("gradient log %s: writing %s failed (%s); the log stops here, training goes on",
                           self.path, what, exc)
            self.close()

    def close(self) -> None:
        """Close the file (rank 0); later records are returned, not written. Idempotent."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:  # the flush of close() on the full disk that stopped the log
                pass

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


#: how every line starts (``json.dumps`` of a record, or of a resumed line, whose first key is
#: ``format``): a line that does not parse and starts so, or is the start of it, is a write cut
#: short by a crash
_HEADS = (json.dumps({"format": FORMAT, "step": 0})[:-2], json.dumps({"format": FORMAT, RESUMED: 0})[:-2])


def _cut(line: str) -> bool:
    """Whether ``line`` (which does not parse) is the start of a line: a write cut short."""
    return any(line.startswith(head) or head.startswith(line) for head in _HEADS)


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a gradient log, in order, each checked field by field (:func:`check_record`).
    A line cut short by a crash in the middle of a write (the start of a record that does not
    parse) is left out: the text after the last newline silently (a run killed, or still
    running, in the middle of a write), one inside the file (a run killed there, then resumed:
    :class:`StepLog` ends the cut line before it appends) with a WARNING on the ``lowgrad``
    logger naming the line. A resumed run's line ``{"format": 1, "resumed": {"step": S}}`` leaves
    out the records above it of step >= S (superseded: the module's docstring). Any other line
    that is not a well-formed record of this format is a ValueError naming the line and the field."""
    where = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if not _cut(line):
                raise ValueError(f"{where}:{number}: not JSON ({exc})") from None
            if number < len(lines):  # the last one may be a write still under way
                logger.warning("gradient log %s:%d: a line cut short by a crash (%d characters), left out",
                               where, number, len(line))
            continue
        try:
            if isinstance(record, dict) and RESUMED in record:
                resumed = check_resumed(record)
                records = [r for r in records if r["step"] < resumed]
            else:
                records.append(check_record(record))
        except ValueError as exc:
            raise ValueError(f"{where}:{number}: {exc}") from None
    return records
