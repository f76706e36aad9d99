"""Diagnostics that cost nothing when off: NVTX ranges and an opt-in trace of every kernel
launch, copy and collective, through the standard ``logging`` logger ``"lowgrad"``.

- NVTX: where the optional ``nvtx`` package is importable, :func:`nvtx_range` pushes and pops a
  named range (visible in Nsight Systems); otherwise it does nothing.
- Trace lines are DEBUG records of the ``lowgrad`` logger, one per kernel launch, copy and
  NCCL call (CUDA) or host kernel and host collective (host backend), with sizes and the stream.
  They are produced while :data:`ENABLED` is true, which is when either

  * ``LOWGRAD_TRACE`` is on (read once, at ``import lowgrad``; :func:`enable` switches it at run time):
    ``1`` (or ``true``, ``on``, ``yes``) writes them to stderr, any other value but the off
    words appends them to the file it names; ``0``, ``false``, ``off``, ``no`` and the empty
    string (any case) leave it off. A file that cannot be opened at import gives a
    RuntimeWarning and leaves the trace off: a diagnostic never stops ``import lowgrad``.
    lowgrad writes these lines itself, through its own handler; they do not propagate to the
    root logger's handlers; or
  * the ``lowgrad`` logger's own level is DEBUG or lower
    (``logging.getLogger("lowgrad").setLevel(logging.DEBUG)``): the records go to the handlers
    you attach, as any logging record does. A DEBUG root logger alone does not switch the trace
    on (one line per launch is too many to get by accident).

  Otherwise the logger holds only a ``NullHandler``. Callers test :data:`ENABLED` (one boolean)
  before building a line, so a disabled trace costs one check per launch.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TextIO

try:
    import nvtx as _nvtx
except ImportError:  # optional
    _nvtx = None

logger = logging.getLogger("lowgrad")
logger.addHandler(logging.NullHandler())

ENABLED: bool = False
_OFF = frozenset({"", "0", "false", "off", "no"})  # LOWGRAD_TRACE words that mean no trace (any case)
_STDERR = frozenset({"1", "true", "on", "yes"})  # words that mean stderr; anything else is a path


class _Writer(logging.Handler):
    """``LOWGRAD_TRACE``'s handler: writes each message as one line to a stream that
    :func:`enable` switches under this handler's lock (the lock every line is written under)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.out: TextIO | None = None
        self.propagate = True  # the logger's setting before this handler took over

    def emit(self, record: logging.LogRecord) -> None:
        if self.out is not None:  # switched off while the record was on its way
            try:
                self.out.write(record.getMessage() + "\n")
            except Exception:  # noqa: BLE001 - a full disk or a closed stderr never breaks a launch
                self.handleError(record)

    def retarget(self, out: TextIO | None) -> TextIO | None:
        """Write to ``out`` from now on (None: nothing); the previous stream."""
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            old, self.out = self.out, out
        return old


_writer = _Writer()
_set_level = logger.setLevel


def _refresh() -> None:
    global ENABLED
    ENABLED = _writer.out is not None or logging.NOTSET < logger.level <= logging.DEBUG


def _set_level_and_refresh(level: int | str) -> None:
    _set_level(level)
    _refresh()


logger.setLevel = _set_level_and_refresh  # type: ignore[method-assign]  # the level switches ENABLED


def _open(target: str | None) -> TextIO | None:
    """Where ``target`` (a ``LOWGRAD_TRACE`` value) sends the lines: None (an off word), stderr
    (an on word) or the file it names, opened for appending (OSError when it cannot be)."""
    if target is None or target.strip().lower() in _OFF:
        return None
    return sys.stderr if target.strip().lower() in _STDERR else open(target, "a", buffering=1)


def enable(target: str | None) -> None:
    """Trace to stderr (``"1"``, ``"true"``, ``"on"``, ``"yes"``), append to a file (a path), or
    stop lowgrad's own output (``None``, ``""``, ``"0"``, ``"false"``, ``"off"``, ``"no"``; any
    case; lines still flow to your handlers while the logger's level is DEBUG): the words of
    ``LOWGRAD_TRACE``. A file that cannot be opened raises OSError and changes nothing. Safe
    while other threads log: the stream is switched, and the previous file closed, under the
    lock every line is written under."""
    new = _open(target)
    old = _writer.retarget(new)
    if new is None and old is not None:
        logger.removeHandler(_writer)
        logger.propagate = _writer.propagate
    elif new is not None and old is None:
        _writer.propagate, logger.propagate = logger.propagate, False
        logger.addHandler(_writer)
    _refresh()
    if old not in (None, sys.stderr, new):
        old.close()  # no writer can hold it: they write under the lock


def log(kind: str, name: str, **fields: Any) -> None:
    """One trace line: ``lowgrad-trace`` time (s, monotonic), thread, kind ("kernel" | "copy" |
    "nccl" | "collective"), name, ``key=value`` fields. The record also carries ``trace_kind``,
    ``trace_name`` and ``trace_fields`` for handlers that filter. Nothing when off."""
    if not ENABLED:
        return
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    line = f"lowgrad-trace {time.monotonic():.6f} {threading.current_thread().name} {kind} {name} {extra}"
    record = logger.makeRecord(logger.name, logging.DEBUG, __file__, 0, line, (), None, None,
                               {"trace_kind": kind, "trace_name": name, "trace_fields": fields})
    logger.handle(record)  # past the level check: LOWGRAD_TRACE writes whatever the level


_NO_RANGE = nullcontext()


def nvtx_range(name: str) -> AbstractContextManager[None]:
    """An NVTX range around the block when the ``nvtx`` package is present (else a shared no-op)."""
    return _NO_RANGE if _nvtx is None else _range(name)


@contextmanager
def _range(name: str) -> Iterator[None]:
    _nvtx.push_range(name)
    try:
        yield
    finally:
        _nvtx.pop_range()


def _enable_from_environment() -> None:
    """Apply ``LOWGRAD_TRACE``; a file that cannot be opened warns and leaves the trace off."""
    target = os.environ.get("LOWGRAD_TRACE")
    try:
        enable(target)
    except OSError as exc:
        warnings.warn(f"lowgrad: LOWGRAD_TRACE={target!r}: cannot open the trace file {target!r} "
                      f"({exc.strerror or exc}); the trace is off", RuntimeWarning, stacklevel=2)


_enable_from_environment()
