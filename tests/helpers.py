"""Small helpers shared by several test files (import as ``from helpers import ...``)."""
from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from lowgrad.base.errors import NvrtcError
from lowgrad.cuda import cache as kcache
from lowgrad.cuda import compiler, nccl


def nccl_loadable() -> bool:
    """Whether the NCCL library loads here (its version and unique-id calls need no GPU)."""
    try:
        nccl.lib()
    except nccl.NcclLibraryError:
        return False
    return True


needs_nccl = pytest.mark.skipif(not nccl_loadable(), reason="no NCCL library installed")


def nvrtc_unavailable() -> str | None:
    """Why NVRTC (the cu12 or cu13 extra's compiler wheel) does not load here, or None where it
    does (compiling needs no GPU)."""
    try:
        compiler.nvrtc_version()
    except NvrtcError as exc:
        return str(exc)
    return None


_NO_NVRTC = nvrtc_unavailable()
needs_nvrtc = pytest.mark.skipif(_NO_NVRTC is not None, reason=f"compiles kernels: no NVRTC library installed "
                                 f"(pip install '.[cu13]' or '.[cu12]'): {_NO_NVRTC}")


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


def assert_rewritten(path: Path) -> None:
    """The cache entry is a private regular file of this user in the current format."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    assert path.read_bytes().startswith(kcache._MAGIC)



_earlier_threads: set[threading.Thread] = set()


def mark_threads() -> None:
    """Remember the threads alive now (tests/conftest.py does before every test)."""
    _earlier_threads.clear()
    _earlier_threads.update(threading.enumerate())


def watchdog_threads() -> list[threading.Thread]:
    """The watchdog threads started since :func:`mark_threads` that are still alive (another test
    file's communicator may still be open, its watchdog alive)."""
    return [t for t in threading.enumerate() if t.name.startswith("lowgrad-watchdog") and t not in _earlier_threads]


def strategy_configs(offload: bool = True) -> list[tuple[str, bool]]:
    """``(strategy, offload)`` for every registered strategy (``lowgrad.managers.STRATEGIES``),
    without offload and, where the strategy offloads (and ``offload``), with it. Read when a test
    module is collected: a strategy registered before that (tests/test_strategy_registered.py's
    plugin) joins every suite parametrized by it."""
    from lowgrad.managers import STRATEGIES

    return [(name, o) for name, cls in STRATEGIES.items() for o in (False, True) if not o or offload and cls.offloads]
