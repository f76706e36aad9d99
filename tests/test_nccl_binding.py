"""The NCCL ctypes binding on the CPU: discovery, version, unique ids and error mapping (no GPU)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

nccl = pytest.importorskip("lowgrad.nccl")


def _loadable() -> bool:
    try:
        nccl.lib()
    except nccl.NcclLibraryError:
        return False
    return True


needs_nccl = pytest.mark.skipif(not _loadable(), reason="no NCCL library installed")


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
        code = "import lowgrad.nccl as n\ntry:\n    n.version()\nexcept n.NcclLibraryError as e:\n    print('ERR', e)\n"
        env = dict(os.environ, LOWGRAD_NCCL_LIBRARY=path)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("ERR LOWGRAD_NCCL_LIBRARY=") and path in out.stdout


def test_import_does_not_load_the_library():
    code = "import lowgrad, lowgrad.nccl as n, lowgrad.comm, lowgrad.bootstrap\nprint(n._lib is None)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
