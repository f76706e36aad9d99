"""The kernel cache cannot be fed (no GPU needed): the directory is private, only this user's
regular files that no one else can write are read (no symlink, FIFO, device, oversized file), an
entry must carry its own full key, and every refusal recompiles and replaces the entry. An unusable
cache directory compiles in memory with one warning. Concurrent compiles of one kernel agree."""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import threading
import warnings
from pathlib import Path

import pytest
from helpers import assert_rewritten, counting_compile, needs_nvrtc

import lowgrad
from lowgrad.cuda import cache as kcache
from lowgrad.cuda import compiler

SRC = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = %s; }'
pytestmark = needs_nvrtc  # every test compiles
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
FOREIGN_UID = 65534  # nobody


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """Every module compiled once for sm_90 into a private directory: (directory, cubins)."""
    d = tmp_path_factory.mktemp("golden") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWGRAD_CACHE_DIR", str(d))
        compiler.clear_memory_cache()
        cubins = lowgrad.compile_kernels("sm_90")
    compiler.clear_memory_cache()
    return d, cubins


@pytest.fixture
def warm(cache: Path, golden: tuple[Path, dict[str, bytes]]) -> Path:
    """``cache`` holding a copy of every golden entry (mode 0600, this user's)."""
    shutil.copytree(golden[0], cache)
    return cache


def entry(cache: Path, module: str) -> Path:
    (path,) = cache.glob(f"{module}-*.cubin")
    return path


def recompiles_fill(warm: Path, golden: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch,
                         warning: str | None) -> None:
    """compile_kernels returns the golden cubins, compiling fill only; ``warning`` (a
    substring) is given once, or no warning at all when None; the entry is rewritten."""
    calls = counting_compile(monkeypatch)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert lowgrad.compile_kernels("sm_90") == golden[1]
    assert calls == ["fill.cu"]
    messages = [str(w.message) for w in got]
    assert len(messages) == (warning is not None) and all(warning in m for m in messages), messages
    assert_rewritten(entry(warm, "fill"))


# ---- the directory -------------------------------------------------------------------------------
def test_directory_is_created_private(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nested = cache / "a" / "b"
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(nested))
    old = os.umask(0o022)
    try:
        compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(nested).st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in nested.glob("k-*.cubin")] == [0o600]


def test_own_readable_directory_is_tightened(cache: Path) -> None:
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def planted(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A valid entry of a small kernel in ``cache``, then a clear process cache and a compile spy."""
    compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    compiler.clear_memory_cache()
    assert len(list(cache.glob("k-*.cubin"))) == 1
    return counting_compile(monkeypatch)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o720])
def test_group_or_world_writable_directory_is_bypassed(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mode: int) -> None:
    calls = planted(cache, monkeypatch)
    before = sorted(p.name for p in cache.iterdir())
    os.chmod(cache, mode)
    with pytest.warns(RuntimeWarning, match="writable by group or others") as got:
        compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    assert len(got) == 1 and calls == ["k.cu"]  # nothing read from it
    assert sorted(p.name for p in cache.iterdir()) == before  # nothing written to it
    assert stat.S_IMODE(os.stat(cache).st_mode) == mode  # and its mode is the user's business


@ROOT_ONLY
def test_directory_of_another_user_is_bypassed(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = planted(cache, monkeypatch)
    os.chown(cache, FOREIGN_UID, FOREIGN_UID)
    with pytest.warns(RuntimeWarning, match=f"owned by uid {FOREIGN_UID}"):
        compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    assert calls == ["k.cu"]


def test_uncreatable_directory_compiles_in_memory_with_one_warning(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(tmp_path / "file" / "cache"))
    compiler.clear_memory_cache()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        one = compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
        two = compiler.compile_cuda(SRC % "2.0f", "k.cu", "sm_90")
    assert [w.category for w in got] == [RuntimeWarning] and "compiled in memory" in str(got[0].message)
    assert one[:4] == two[:4] == b"\x7fELF" and one != two
    calls = counting_compile(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90") is one and calls == []  # held in the process


def test_unwritable_directory_compiles_with_one_warning(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only file system (EROFS on create; root ignores mode bits, so it is simulated)."""
    def read_only(dfd: int, stem: str) -> tuple[int, str]:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(kcache, "_create_temp", read_only)
    with pytest.warns(RuntimeWarning, match="cannot write to the kernel cache") as got:
        cubins = lowgrad.compile_kernels("sm_90")  # six misses, compiled in parallel threads
    assert len(got) == 1 and list(cubins) == list(compiler.modules())
    assert list(cache.iterdir()) == []


# ---- the entries ------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage", "header only"])
def test_damaged_entry_is_recompiled_silently(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                              monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    """A damaged entry (a crash mid-write, a bad disk) is no attack: no warning, rewritten whole."""
    path = entry(warm, "fill")
    data = path.read_bytes()
    head = len(kcache._MAGIC) + 4 + len(compiler._source_job("fill", "sm_90").header) + 32
    path.write_bytes({"truncate": data[:len(data) // 2], "flip": data[:-1] + bytes([data[-1] ^ 1]),
                      "empty": b"", "garbage": bytes(range(256)) * 40, "header only": data[:head]}[damage])
    recompiles_fill(warm, golden, monkeypatch, None)
    assert path.read_bytes() == data and not list(warm.glob("*.tmp"))


def test_forged_entry_with_a_valid_self_checksum_is_not_loaded(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    forged = b"\x7fELF forged cubin"
    path = entry(warm, "fill")
    path.write_bytes(b"LGCUBIN1" + hashlib.sha256(forged).digest() + forged)  # the old format, self-consistent
    recompiles_fill(warm, golden, monkeypatch, None)


def test_entry_of_another_kernel_renamed_is_not_loaded(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copyfile(entry(warm, "philox_kat"), entry(warm, "fill"))
    recompiles_fill(warm, golden, monkeypatch, None)
    assert golden[1]["fill"] != golden[1]["philox_kat"]


def test_entry_for_another_nvrtc_is_not_loaded(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The header is checked, not only the name: same file name, another key inside."""
    job = compiler._source_job("fill", "sm_90")
    other = job.header.replace(compiler.nvrtc_identity().encode(), b"nvrtc 99.0")
    assert other != job.header
    bad = kcache.Job(job.name, job.source, job.headers, job.options, other, job.key)
    entry(warm, "fill").write_bytes(kcache._encode(bad, golden[1]["philox_kat"]))
    recompiles_fill(warm, golden, monkeypatch, None)


@pytest.mark.timeout(60)
def test_fifo_entry_does_not_hang(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = entry(warm, "fill")
    path.unlink()
    os.mkfifo(path, 0o600)
    recompiles_fill(warm, golden, monkeypatch, "is not a regular file")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["valid copy", "/dev/zero"])
def test_symlinked_entry_is_refused_unread(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: str) -> None:
    path = entry(warm, "fill")
    if target == "valid copy":  # a link to a perfectly good entry of this user is refused all the same
        target = str(shutil.copy2(path, tmp_path / "elsewhere.cubin"))
    path.unlink()
    path.symlink_to(target)
    recompiles_fill(warm, golden, monkeypatch, "is a symbolic link")


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_entry_writable_by_others_is_refused(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                             monkeypatch: pytest.MonkeyPatch, mode: int) -> None:
    os.chmod(entry(warm, "fill"), mode)
    recompiles_fill(warm, golden, monkeypatch, "writable by group or others")


@ROOT_ONLY
def test_entry_of_another_user_is_refused_and_replaced(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    os.chown(entry(warm, "fill"), FOREIGN_UID, FOREIGN_UID)
    recompiles_fill(warm, golden, monkeypatch, f"owned by uid {FOREIGN_UID}")


def test_directory_in_place_of_an_entry_is_refused(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """It cannot be replaced either: the cubin is still returned, with a second warning."""
    path = entry(warm, "fill")
    path.unlink()
    (path / "x").mkdir(parents=True)
    calls = counting_compile(monkeypatch)
    with pytest.warns(RuntimeWarning) as got:
        assert lowgrad.compile_kernels("sm_90") == golden[1]
    assert calls == ["fill.cu"] and path.is_dir()
    assert [m for m in map(str, (w.message for w in got)) if "not a regular file" in m]
    assert not list(warm.glob("*.tmp"))


def test_oversized_entry_is_refused_unread(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    big = entry(warm, "fill")
    others = sum(p.stat().st_size for p in warm.glob("*.cubin") if p != big)
    read: list[int] = []
    real = os.read

    def counted(fd: int, n: int) -> bytes:
        data = real(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(kcache.os, "read", counted)
    os.truncate(big, kcache.MAX_ENTRY_BYTES + 1)  # sparse: costs no disk
    recompiles_fill(warm, golden, monkeypatch, "larger than 64 MiB")
    assert sum(read) == others  # every other entry whole, not one byte of the big one


def test_entry_growing_past_the_bound_is_read_no_further(warm: Path, golden: tuple[Path, dict[str, bytes]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The size checked by fstat may be stale: at most the bound plus one byte is read."""
    monkeypatch.setattr(kcache, "MAX_ENTRY_BYTES", 1000)
    path = entry(warm, "fill")
    real_fstat = os.fstat

    def shrunk(fd: int) -> os.stat_result:  # report the size as it was before the file grew
        st = list(real_fstat(fd))
        st[stat.ST_SIZE] = 10
        return os.stat_result(st)

    monkeypatch.setattr(kcache.os, "fstat", shrunk)
    reads: list[int] = []
    real = os.read
    monkeypatch.setattr(kcache.os, "read", lambda fd, n: reads.append(n) or real(fd, n))
    assert path.stat().st_size > 1001
    with pytest.warns(RuntimeWarning, match="larger than"):
        compiler.compile_source("fill", "sm_90")
    assert sum(reads) == 1001


# ---- concurrency -------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_two_threads_compiling_one_kernel_agree(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both miss and compile (no lock held meanwhile), both get the very same bytes, one entry."""
    barrier = threading.Barrier(2, timeout=30)
    real = compiler._compile

    def both_inside(source, name, headers, opts, ptx=False):
        assert not kcache._memo_lock.locked()
        barrier.wait()  # both threads are compiling at once: nothing serialises them
        return real(source, name, headers, opts, ptx)

    monkeypatch.setattr(compiler, "_compile", both_inside)
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(compiler.compile_cuda(SRC % "3.0f", "k.cu", "sm_90")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert len(out) == 2 and out[0] is out[1]
    assert len(list(cache.glob("k-*.cubin"))) == 1 and not list(cache.glob("*.tmp"))
