"""Small helpers shared by several test files (import as ``from helpers import ...``)."""
from __future__ import annotations

import logging

import pytest

from lowgrad.cuda import compiler


class Records(logging.Handler):
    """A logging handler that keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def counting_compile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the program names that really reach NVRTC."""
    calls: list[str] = []
    real = compiler._compile

    def spy(source, name, headers, opts, ptx=False):  # type: ignore[no-untyped-def]
        calls.append(name)
        return real(source, name, headers, opts, ptx)

    monkeypatch.setattr(compiler, "_compile", spy)
    return calls
