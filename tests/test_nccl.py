"""The NCCL ctypes binding on the CPU: discovery, version, unique ids and error mapping (no GPU)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import needs_nccl

from lowgrad.cuda import nccl


@needs_nccl
def test_loads_and_reports_version():
    path = nccl.library_path()
    assert os.path.basename(path).startswith("libnccl.so")
    major, minor, patch = nccl.version()
    assert major == 2 and 0 <= minor < 100 and 0 <= patch < 100
    if not os.environ.get("LOWGRAD_NCCL_LIBRARY"):
        assert "site-packages" in path or "dist-packages" in path or "/lib" in path


@needs_nccl
def test_unique_id_is_128_fresh_bytes():
    a, b = nccl.unique_id(), nccl.unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and len(b) == 128
    assert a != b


@needs_nccl
def test_error_code_maps_to_nccl_message():
    err = nccl.error("ncclAllReduce", 4)
    assert isinstance(err, nccl.NcclError)
    assert (err.call, err.code, err.name) == ("ncclAllReduce", 4, "ncclInvalidArgument")
    assert "invalid argument" in err.message
    assert "ncclAllReduce" in str(err) and "ncclInvalidArgument" in str(err)
    with pytest.raises(nccl.NcclError, match="ncclInternalError"):
        nccl.check("ncclGroupEnd", 3)
    assert nccl.check("ncclGroupEnd", nccl.IN_PROGRESS) == nccl.IN_PROGRESS
    assert nccl.check("ncclGroupEnd", 0) == 0
    assert "ncclResult_t 99" in str(nccl.error("x", 99))


@needs_nccl
def test_config_struct_mirrors_the_2_18_layout():
    # size, magic, version, blocking, cgaClusterSize, minCTAs, maxCTAs, netName, splitShare
    assert nccl._Config.blocking.offset == 16
    assert nccl._Config.netName.offset == 32
    assert nccl._CONFIG_SIZE == 44


def test_bad_library_path_gives_clear_error(tmp_path):
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"not a shared object")
    for path in (str(tmp_path / "missing.so"), str(bogus)):
        code = ("import lowgrad.cuda.nccl as n\ntry:\n    n.version()\n"
                "except n.NcclLibraryError as e:\n    print('ERR', e)\n")
        env = dict(os.environ, LOWGRAD_NCCL_LIBRARY=path)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("ERR LOWGRAD_NCCL_LIBRARY=") and path in out.stdout


def test_import_does_not_load_the_library():
    code = ("import lowgrad, lowgrad.cuda.nccl as n, lowgrad.cuda.communicator, lowgrad.launch.bootstrap\n"
            "print(n._lib is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


_FAKE_NCCL = "int ncclGetVersion(int *v) { *v = 21803; return 0; }\n"  # NCCL's first symbol only


def _load_error(path: str) -> str:
    """What loading ``path`` as LOWGRAD_NCCL_LIBRARY raises, from a fresh interpreter."""
    code = ("import lowgrad.cuda.nccl as n\ntry:\n    n.version()\nexcept n.NcclLibraryError as e:\n"
            "    print('ERR', e)\n")
    env = dict(os.environ, LOWGRAD_NCCL_LIBRARY=path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr  # an AttributeError escaped before
    assert out.stdout.startswith("ERR "), out.stdout
    return out.stdout


def test_a_library_that_is_not_nccl_names_path_and_symbol():
    import ctypes.util

    libm = ctypes.util.find_library("m") or ctypes.util.find_library("c")
    if libm is None:
        pytest.skip("no libm/libc to stand in for a non-NCCL library")
    msg = _load_error(libm)
    assert libm in msg and "lacks the symbol ncclGetVersion: not an NCCL library" in msg


def test_a_library_missing_one_symbol_names_it(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a partial NCCL (the in-process variant below covers it)")
    src, lib = tmp_path / "fake.c", tmp_path / "libnccl.so.2"
    src.write_text(_FAKE_NCCL)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    msg = _load_error(str(lib))
    assert str(lib) in msg and "ncclCommInitRankConfig" in msg and "ncclGetVersion," not in msg
    assert "lowgrad needs NCCL 2.18 or newer" in msg


@needs_nccl
def test_a_symbol_missing_from_the_real_library_is_a_library_error(monkeypatch):
    path = nccl.library_path()
    monkeypatch.setitem(nccl._PROTOTYPES, "ncclNoSuchSymbol", ())
    monkeypatch.setattr(nccl, "_lib", None)
    monkeypatch.setenv("LOWGRAD_NCCL_LIBRARY", path)
    with pytest.raises(nccl.NcclLibraryError, match="ncclNoSuchSymbol") as info:
        nccl.version()
    assert path in str(info.value) and "lowgrad needs NCCL 2.18 or newer" in str(info.value)
    from lowgrad.base.errors import NcclLibraryError

    assert nccl.NcclLibraryError is NcclLibraryError


def test_library_candidates_is_the_one_search_order(monkeypatch, tmp_path):
    """The variable alone when set (and a library it names that is missing is not "absent": the
    doctor calls it FAILED); else the wheels', find_library's and the loader's name, each once."""
    named = str(tmp_path / "libnccl.so.2")
    monkeypatch.setenv(nccl.LIBRARY_ENV, named)
    assert nccl.library_candidates() == [named] and not nccl.library_absent()
    monkeypatch.delenv(nccl.LIBRARY_ENV)
    found = nccl.library_candidates()
    assert found[-1] == "libnccl.so.2" and len(found) == len(set(found))
    wheels = nccl._wheel_candidates()
    assert found[:len(wheels)] == wheels
    monkeypatch.setattr(nccl, "_wheel_candidates", lambda: [])
    monkeypatch.setattr(nccl.ctypes.util, "find_library", lambda name: None)
    assert nccl.library_candidates() == ["libnccl.so.2"]
    monkeypatch.setattr(nccl.ctypes, "CDLL", _raise(OSError("libnccl.so.2: cannot open shared object file: No such")))
    assert nccl.library_absent()
    monkeypatch.setattr(nccl.ctypes, "CDLL", _raise(OSError("libcudart.so.12: cannot open shared object file")))
    assert not nccl.library_absent()  # libnccl is there; a dependency of it is missing: broken, not absent


def _raise(exc):
    def f(*args, **kwargs):
        raise exc
    return f


def test_only_the_binding_reads_the_library_variable():
    """One way to find NCCL: every other module asks lowgrad.cuda.nccl (LIBRARY_ENV, library_candidates)."""
    from pathlib import Path

    root = Path(nccl.__file__).resolve().parents[2]
    readers = [str(p.relative_to(root)) for d in ("lowgrad", "tools", "examples") for p in (root / d).rglob("*.py")
               if "LOWGRAD_NCCL_LIBRARY" in p.read_text()]
    assert readers == ["lowgrad/cuda/nccl.py"]
