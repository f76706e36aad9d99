"""``LOWGRAD_TRACE`` as ``import lowgrad`` reads it: the off words turn the trace off, the on
words and paths turn it on, and a file that cannot be opened warns instead of failing the import."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowgrad.base import trace

CODE = ("import lowgrad as lg; from lowgrad.base import trace; h = lg.HostDevice(); "
        "a = h.alloc(4, lg.bf16, name='x'); lg.ops.copy(a, a); print(trace.ENABLED)")


def _import(value: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``CODE`` in a fresh interpreter in ``cwd`` with ``LOWGRAD_TRACE=value``."""
    env = {"LOWGRAD_TRACE": value, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=120,
                          env=env, cwd=cwd)


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "Off", "no", "", " 0 "])
def test_off_words_turn_the_trace_off_and_create_no_file(tmp_path: Path, value: str) -> None:
    out = _import(value, tmp_path)
    assert out.stdout.strip() == "False"
    assert "lowgrad-trace" not in out.stderr and "Warning" not in out.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes"])
def test_on_words_trace_to_stderr(tmp_path: Path, value: str) -> None:
    out = _import(value, tmp_path)
    assert out.stdout.strip() == "True" and "copy device->device" in out.stderr
    assert os.listdir(tmp_path) == []


def test_a_path_appends_to_that_file(tmp_path: Path) -> None:
    log = tmp_path / "trace.log"
    log.write_text("earlier\n")
    out = _import(str(log), tmp_path)
    assert out.stdout.strip() == "True" and "lowgrad-trace" not in out.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier" and "copy device->device" in lines[1]


@pytest.mark.parametrize("where", ["missing/trace.log", "."])
def test_an_unopenable_path_warns_and_import_succeeds(tmp_path: Path, where: str) -> None:
    target = str(tmp_path / where)
    out = _import(target, tmp_path)
    assert out.stdout.strip() == "False" and "lowgrad-trace" not in out.stderr
    assert "RuntimeWarning" in out.stderr and "LOWGRAD_TRACE" in out.stderr and target in out.stderr
    assert ("No such file or directory" if where != "." else "Is a directory") in out.stderr
    assert not (tmp_path / "missing").exists()


def test_import_lowgrad_alone_applies_the_variable(tmp_path: Path) -> None:
    """docs/cli.md: an unopenable ``LOWGRAD_TRACE`` warns at ``import lowgrad`` (it warned at the
    first device or manager only, the module that reads it being loaded then)."""
    target = str(tmp_path / "missing" / "trace.log")
    env = {"LOWGRAD_TRACE": target, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", "import lowgrad"], capture_output=True, text=True, check=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert "RuntimeWarning" in out.stderr and target in out.stderr, out.stderr


def test_enable_takes_the_same_words() -> None:
    try:
        for word in ("1", "Yes", "on"):
            trace.enable(word)
            assert trace.ENABLED
            trace.enable("OFF")
            assert not trace.ENABLED
        trace.enable("true")
        trace.enable("0")
        assert not trace.ENABLED
    finally:
        trace.enable(None)


def test_enable_of_an_unopenable_path_raises_and_changes_nothing(tmp_path: Path) -> None:
    trace.enable("1")
    try:
        with pytest.raises(FileNotFoundError):
            trace.enable(str(tmp_path / "missing" / "trace.log"))
        assert trace.ENABLED  # still tracing to stderr
    finally:
        trace.enable(None)
    assert not trace.ENABLED
